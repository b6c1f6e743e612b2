"""`Member`: one instance the relay follows, its batches as records queued for JetStream, and
the records sent whose acknowledgement is awaited.

- `pending` holds the records not sent yet, about `buffer` of them, and all members' records
  (queued or in flight) hold at most `buffer_bytes` of payload, plus a batch or two a member
  (`RelayStats.queued_bytes`; batches are up to 4 MiB): when either is full, the subscription
  that feeds the member waits (`room`) and the worker keeps what it publishes meanwhile (its
  replay buffer), so a NATS outage costs no batch the worker can still replay. A member with
  nothing queued or in flight takes a batch whatever the others hold: one worker's flood never
  holds another's subscription. Past
  `buffer + WINDOW` records (never, with a subscription that waits for room) its batches are
  dropped and a `resnapshot` record (from the batch that follows) takes their place, so a
  consumer forgets the instance's blocks rather than keep evicted ones.
- `inflight` holds the records sent, in the order sent, at most `WINDOW` of them and
  `WINDOW_BYTES` of payload (past it, one record at a time): each is retired
  when the stream acknowledges it and every record before it; one that fails (an error, no
  acknowledgement in time, the connection lost) sends it and every record after it again,
  with the same message ids (the stream refuses what it already stored).
- Every member's records in flight are counted together too (`RelayStats.flying`,
  `flying_records`): the relay's sender holds them to its relay-wide budget (`Turns`).
- `notify(member)` tells the relay's sender the member has something to do: records to
  send, room in its window again (or in the relay's budget, while the sender waits for it),
  a failure to handle, its `left` acknowledged.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.kv import KvEndpoint, KVEventBatch, encode_batch
from shoal.kv import stream as layout
from shoal.kv.subscription import KvStats, KvSubscription

MemberKey = tuple[str, int]  # (namespace, instance id): one subject
WINDOW = 128  # records of one member sent and not acknowledged yet, at most
# and their payload bytes: the stream stores every member's records in one order, so a member
# flooding 128 large batches ahead put ~64-128 MB before every other member's next record
WINDOW_BYTES = 4 << 20
BUFFER_BYTES = 256 << 20  # payload bytes queued by all members at once (batches: <= 4 MiB)

# A record's acknowledgement, once it came.
WAITING, STORED, DUPLICATE, FAILED = 0, 1, 2, 3


class RelayStats:
    """Counters shown on `/metrics` (the subscriptions' own in `subscriptions`)."""

    def __init__(self) -> None:
        self.relayed = 0  # batches the stream stored
        self.duplicates = 0  # records the stream refused as already stored (by id)
        self.dropped = 0  # batches dropped from a full queue (a resnapshot replaced them)
        self.resnapshots = 0  # resnapshot records queued
        self.publish_errors = 0
        self.queued_bytes = 0  # payload bytes of every member's records, queued or in flight
        self.flying = 0  # payload bytes of every member's records in flight
        self.flying_records = 0  # and those records
        self.starved = False  # the sender waits for records in flight to be retired
        self.answers_dropped = 0  # acknowledgements nats-py dropped (slow consumer): sent again
        self.subscriptions = KvStats()
        self.short: set[Member] = set()  # members waiting for `queued_bytes` to go down


@dataclass(eq=False, slots=True)
class Record:
    kind: str
    seq: int = -1
    ts: float = 0.0
    payload: bytes = b""
    token: str = ""  # the reply subject's token while its acknowledgement is awaited
    sent: float = 0.0  # when it was sent (the event loop's clock)
    outcome: int = WAITING

    def headers(self, member: Member) -> dict[str, str]:
        kind, (namespace, instance_id) = self.kind, member.key
        if kind == layout.BATCH:
            msg_id = layout.batch_id(namespace, instance_id, self.seq, self.ts)
        elif kind == layout.RESNAPSHOT:
            msg_id = layout.resnapshot_id(namespace, instance_id, self.seq, self.ts)
        else:  # (a `left` carries the last batch's seq and ts: -1 and 0 after none)
            msg_id = layout.control_id(namespace, instance_id, kind, member.run, self.seq, self.ts)
            return {layout.KIND: kind, layout.MSG_ID: msg_id}
        return {
            layout.KIND: kind,
            layout.SEQ: str(self.seq),
            layout.TS: repr(self.ts),
            layout.MSG_ID: msg_id,
        }


@dataclass(eq=False)
class Member:
    """One followed instance: its subscription's batches as records, queued for JetStream."""

    key: MemberKey
    subject: str
    endpoint: KvEndpoint
    joined: layout.Joined
    stats: RelayStats
    buffer: int
    buffer_bytes: int = BUFFER_BYTES  # of all members' records (`stats.queued_bytes`)
    pending: deque[Record] = field(default_factory=deque)
    inflight: deque[Record] = field(default_factory=deque)
    notify: Callable[[Member], None] = lambda member: None
    last_seq: int = -1  # the worker's number of the last batch queued
    last_ts: float = 0.0  # and its timestamp
    # names this run of the instance in message ids: the card's store revision (`r...`, the
    # same for every relay) when known, else a token of this relay's own
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    owed: bool = False  # a resnapshot goes before the next batch
    lag_ms: float | None = None
    leaving: bool = False
    failed: str | None = None  # why the records in flight are to be sent again
    delay: float = 0.1  # the pause before sending again after a failure
    retry_at: float = 0.0  # (the event loop's clock) not sent before
    queued: int = 0  # payload bytes of this member's records, queued or in flight
    flying: int = 0  # payload bytes of its records in flight
    subscription: KvSubscription | None = None
    follows: Member | None = None  # the same instance's run before, still sending: first
    roomy: asyncio.Event = field(default_factory=asyncio.Event)  # the queue has room again

    @property
    def instance_id(self) -> int:
        return self.key[1]

    # -- the subscription's side --------------------------------------------------------------

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        if self.leaving:  # (its subscription, stopped in a task, not cancelled yet)
            return  # `left` is the run's last record
        ts = batch.ts
        if self.owed:
            self.owed = False
            self.push(Record(layout.RESNAPSHOT, seq, ts))
        self.push(Record(layout.BATCH, seq, ts, encode_batch(batch)))
        self.last_seq, self.last_ts = seq, ts

    def resnapshot(self) -> None:
        self.owed = True

    async def room(self) -> None:
        """Until the queue has room for a batch (and a resnapshot before it), and all
        members' records are within `buffer_bytes` or none of them is this member's."""
        stats = self.stats
        try:
            while True:
                if len(self.pending) + 2 > self.buffer:
                    pass  # `taken` wakes it
                elif stats.queued_bytes > self.buffer_bytes and self.queued:
                    stats.short.add(self)  # `_freed` wakes it
                else:
                    return
                self.roomy.clear()
                await self.roomy.wait()
        finally:
            stats.short.discard(self)

    def taken(self) -> None:
        """Records left the queue (sent): a subscription waiting for room goes on."""
        if len(self.pending) + 2 <= self.buffer:
            self.roomy.set()

    def _freed(self, size: int) -> None:
        stats = self.stats
        stats.queued_bytes -= size
        self.queued -= size
        if stats.short and stats.queued_bytes <= self.buffer_bytes:
            for member in stats.short:
                member.roomy.set()
            stats.short.clear()
        elif not self.queued and self in stats.short:  # (nothing of its own held: it goes on)
            stats.short.discard(self)
            self.roomy.set()

    def leave(self) -> None:
        self.leaving = True
        self.pending.append(Record(layout.LEFT, self.last_seq, self.last_ts))
        self.notify(self)

    def push(self, record: Record) -> None:
        """Queue `record` (never blocks: `room` is where a subscription waits)."""
        if len(self.pending) >= self.buffer + WINDOW:
            kept = [r for r in self.pending if r.kind == layout.JOINED]
            dropped = [r for r in self.pending if r.kind != layout.JOINED]
            self.stats.dropped += sum(1 for r in dropped if r.kind == layout.BATCH)
            self.pending.clear()  # in place: the publisher may be going through it
            self.pending.extend(kept)
            self._freed(sum(len(r.payload) for r in dropped))
            if record.kind == layout.BATCH:
                self.stats.resnapshots += 1
                self.pending.append(Record(layout.RESNAPSHOT, record.seq, record.ts))
        if record.kind == layout.RESNAPSHOT:
            self.stats.resnapshots += 1
        self.pending.append(record)
        self.stats.queued_bytes += len(record.payload)
        self.queued += len(record.payload)
        self.notify(self)

    def replace_head(self, record: Record) -> None:
        """The first queued record is replaced by `record` (one NATS cannot take)."""
        self._freed(len(self.pending[0].payload) - len(record.payload))
        self.pending[0] = record

    # -- the stream's side --------------------------------------------------------------------

    def acknowledged(self, record: Record, outcome: int, why: str = "") -> None:
        """The stream's answer to `record`: retire what is acknowledged from the head on, in
        order; a failure has the publisher send the records in flight again."""
        record.outcome = outcome
        if outcome == FAILED:
            self.failed = why or "refused"
            self.notify(self)
            return
        inflight = self.inflight
        was_full = self.window_full
        stats = self.stats
        newest = None
        size = retired = 0
        while inflight and inflight[0].outcome in (STORED, DUPLICATE):
            done = inflight.popleft()
            size += len(done.payload)
            retired += 1
            self.flying -= len(done.payload)
            self.delay = 0.1
            if done.outcome == DUPLICATE:
                stats.duplicates += 1
            elif done.kind == layout.BATCH:
                stats.relayed += 1
            if done.kind == layout.BATCH:
                newest = done.ts
        if newest is not None:
            self.lag_ms = max(0.0, (time.time() - newest) * 1000)
        stats.flying -= size
        stats.flying_records -= retired
        if size:
            self._freed(size)
        if was_full or (self.leaving and not inflight) or (retired and stats.starved):
            self.notify(self)

    def too_large(self, record: Record, why: str) -> None:
        """The stream refuses `record` for good (over its `max_msg_size`): a `resnapshot`
        (from the batch that follows) takes its place, a loss told as one, and is sent again
        with the records after it."""
        if record.kind == layout.BATCH:
            self.stats.dropped += 1
        self.stats.resnapshots += 1
        self._freed(len(record.payload))
        record.kind, record.seq, record.payload = layout.RESNAPSHOT, record.seq + 1, b""
        self.acknowledged(record, FAILED, why)

    @property
    def window_full(self) -> bool:
        """Whether no record is sent before an acknowledgement frees room."""
        return len(self.inflight) >= WINDOW or self.flying >= WINDOW_BYTES

    def sent(self, record: Record) -> None:
        """`record`, the first queued, was sent: in flight now."""
        self.pending.popleft()
        self.inflight.append(record)
        self.flying += len(record.payload)
        self.stats.flying += len(record.payload)
        self.stats.flying_records += 1

    def expired(self, now: float, timeout: float) -> bool:
        return bool(self.inflight) and now - self.inflight[0].sent > timeout

    def rewind(self) -> list[Record]:
        """Put the records in flight back at the head of the queue, in order (to be sent
        again); returns them (their tokens are to be forgotten)."""
        again = list(self.inflight)
        for record in reversed(again):
            record.outcome = WAITING
            self.pending.appendleft(record)
        self.stats.flying -= self.flying
        self.stats.flying_records -= len(self.inflight)
        self.inflight.clear()
        self.flying = 0
        self.failed = None
        return again

    def status(self) -> dict[str, Any]:
        return {
            "namespace": self.key[0],
            "instance_id": f"{self.instance_id:x}",
            "subject": self.subject,
            "last_seq": self.last_seq,
            "pending": len(self.pending) + len(self.inflight),
            "lag_ms": self.lag_ms,
        }
