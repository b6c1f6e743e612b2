"""`Member`: one instance the relay follows, its batches as records queued for JetStream, and
the records sent whose acknowledgement is awaited.

- `pending` holds the records not sent yet, at most `buffer` of them: past that its batches
  are dropped and a `resnapshot` record (from the batch that follows) takes their place, so a
  consumer forgets the instance's blocks rather than keep evicted ones. Nothing blocks the
  subscription that feeds it.
- `inflight` holds the records sent, in the order sent, at most `WINDOW`: each is retired
  when the stream acknowledges it and every record before it; one that fails (an error, no
  acknowledgement in time, the connection lost) sends it and every record after it again,
  with the same message ids (the stream refuses what it already stored).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shoal.kv import KvEndpoint, KVEventBatch, encode_batch
from shoal.kv import stream as layout
from shoal.kv.subscription import KvStats, KvSubscription

MemberKey = tuple[str, int]  # (namespace, instance id): one subject
WINDOW = 256  # records of one member sent and not acknowledged yet, at most

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
        self.subscriptions = KvStats()


@dataclass(eq=False, slots=True)
class Record:
    kind: str
    seq: int = -1
    ts: float = 0.0
    payload: bytes = b""
    token: str = ""  # the reply subject's token while its acknowledgement is awaited
    sent: float = 0.0  # when it was sent (the event loop's clock)
    outcome: int = WAITING

    def headers(self, instance_id: int) -> dict[str, str]:
        kind = self.kind
        if kind == layout.BATCH:
            msg_id = layout.batch_id(instance_id, self.seq, self.ts)
        elif kind == layout.RESNAPSHOT:
            msg_id = layout.resnapshot_id(instance_id, self.seq, self.ts)
        else:
            return {layout.KIND: kind, layout.MSG_ID: f"{instance_id:x}:{kind}"}
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
    pending: deque[Record] = field(default_factory=deque)
    inflight: deque[Record] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    last_seq: int = -1
    owed: bool = False  # a resnapshot goes before the next batch
    lag_ms: float | None = None
    leaving: bool = False
    failed: str | None = None  # why the records in flight are to be sent again
    delay: float = 0.1  # the pause before sending again after a failure
    timer: asyncio.TimerHandle | None = None  # wakes the publisher when an ack is late
    subscription: KvSubscription | None = None
    task: asyncio.Task[None] | None = None

    @property
    def instance_id(self) -> int:
        return self.key[1]

    # -- the subscription's side --------------------------------------------------------------

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        ts = batch.ts
        if self.owed:
            self.owed = False
            self._push(Record(layout.RESNAPSHOT, seq, ts))
        self._push(Record(layout.BATCH, seq, ts, encode_batch(batch)))
        self.last_seq = seq

    def resnapshot(self) -> None:
        self.owed = True

    def leave(self) -> None:
        self.leaving = True
        self.pending.append(Record(layout.LEFT))
        self.wake.set()

    def _push(self, record: Record) -> None:
        if len(self.pending) >= self.buffer:
            kept = [r for r in self.pending if r.kind == layout.JOINED]
            self.stats.dropped += sum(1 for r in self.pending if r.kind == layout.BATCH)
            self.pending.clear()  # in place: the publisher may be going through it
            self.pending.extend(kept)
            if record.kind == layout.BATCH:
                self.stats.resnapshots += 1
                self.pending.append(Record(layout.RESNAPSHOT, record.seq, record.ts))
        if record.kind == layout.RESNAPSHOT:
            self.stats.resnapshots += 1
        self.pending.append(record)
        self.wake.set()

    # -- the stream's side --------------------------------------------------------------------

    def acknowledged(self, record: Record, outcome: int, why: str = "") -> None:
        """The stream's answer to `record`: retire what is acknowledged from the head on, in
        order; a failure has the publisher send the records in flight again."""
        record.outcome = outcome
        if outcome == FAILED:
            self.failed = why or "refused"
            self.wake.set()
            return
        inflight = self.inflight
        was_full = len(inflight) >= WINDOW
        stats = self.stats
        newest = 0.0
        while inflight and inflight[0].outcome in (STORED, DUPLICATE):
            done = inflight.popleft()
            if done.outcome == DUPLICATE:
                stats.duplicates += 1
            elif done.kind == layout.BATCH:
                stats.relayed += 1
            if done.kind == layout.BATCH:
                newest = done.ts
        if newest:
            self.lag_ms = max(0.0, (time.time() - newest) * 1000)
            self.delay = 0.1
        if was_full or (self.leaving and not inflight):
            self.wake.set()

    def expired(self, now: float, timeout: float) -> bool:
        return bool(self.inflight) and now - self.inflight[0].sent > timeout

    def rewind(self) -> list[Record]:
        """Put the records in flight back at the head of the queue, in order (to be sent
        again); returns them (their tokens are to be forgotten)."""
        again = list(self.inflight)
        for record in reversed(again):
            record.outcome = WAITING
            self.pending.appendleft(record)
        self.inflight.clear()
        self.failed = None
        return again

    def arm(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """Wake the publisher when the oldest record in flight is overdue."""
        if self.inflight and self.timer is None:
            self.timer = loop.call_at(self.inflight[0].sent + timeout, self._late)

    def _late(self) -> None:
        self.timer = None
        self.wake.set()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def status(self) -> dict[str, Any]:
        return {
            "namespace": self.key[0],
            "instance_id": f"{self.instance_id:x}",
            "subject": self.subject,
            "last_seq": self.last_seq,
            "pending": len(self.pending) + len(self.inflight),
            "lag_ms": self.lag_ms,
        }
