"""`Sender`: the one task that sends every member's records to JetStream, and `Turns`, the
order in which members send within the relay's budget of records in flight.

Each member's records go out in order, up to its window (`Member.window_full`) ahead of their
acknowledgements (`AckInbox`); one that fails or is not acknowledged in time is sent again,
and every record after it, from the first one (the same message ids), after a pause. The
sender waits `linger` seconds after the first record to send, so that the records of many
members go out in one write to the socket (the write is the dearest part of a small record).

The relay's budget: every member's records in flight (`RelayStats.flying`, `flying_records`)
are held together to at most `inflight_bytes` of payload (a record larger than that goes
alone) and `inflight_records` records. The stream stores every member's records in one
order, so what is in flight is what a member's next record waits behind: 20 members flooding
had 4 MiB in flight each (their own window), and a quiet member's batch was sent behind
~80 MB of theirs. The members with a record to send take turns in the order they came, a
turn sending records until `QUANTUM` bytes (at least one record), then going to the back: a
member that had nothing to send waits behind at most the budget and one turn of each other
member, whatever their backlogs, and a member of many small batches sends them in one turn
(one record a turn held it to one small batch a round, behind 20 large ones: its own queue
grew through a flood).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

import nats.errors
from nats.aio.client import Client

from shoal.kv import stream as layout
from shoal.relay.acks import AckInbox
from shoal.relay.member import Member, Record, RelayStats

log = logging.getLogger(__name__)

INFLIGHT_BYTES = 8 << 20  # payload bytes of all members' records in flight, at most
INFLIGHT_RECORDS = 4096  # and records
QUANTUM = 64 << 10  # payload bytes a member sends in its turn (at least one record)
SKIPS = 1024  # members that cannot send taken out of the turns before yielding
BACKOFF_MAX = 5.0  # seconds before a member sends again after failures, at most
YIELD_SECONDS = 0.005  # the sender yields to the event loop after sending this long


class Turns:
    """The members with a record to send, first served first, and whether the relay's budget
    takes a record now. A member that cannot send (its window full, a failure to handle, a
    pause, a run before it still sending) leaves its turn: it has one again when notified."""

    def __init__(
        self,
        stats: RelayStats,
        max_bytes: int = INFLIGHT_BYTES,
        max_records: int = INFLIGHT_RECORDS,
    ) -> None:
        self.stats = stats
        self.max_bytes = max_bytes
        self.max_records = max(1, max_records)
        # (an OrderedDict: a plain dict's first key is found past every key deleted before
        # it, so a queue of 20,000 members served from its front took O(n^2))
        self.order: OrderedDict[Member, None] = OrderedDict()
        self.current: Member | None = None  # the member whose turn it is
        self.spent = 0  # and the bytes it sent in it
        self.cut = False  # `next` gave up after `SKIPS` members that cannot send: more to see

    def add(self, member: Member) -> None:
        """`member` has a record to send: a turn at the back (its place, when it has one)."""
        self.order.setdefault(member, None)

    def next(self, now: float) -> Member | None:
        """The first member whose turn it is, when the budget takes its record now; None when
        the budget is spent (`stats.starved`: a record retired wakes the sender) or no
        member has a record to send, or `cut` (20,000 members failed at once, by a lost
        connection, are taken out `SKIPS` a call)."""
        order, stats = self.order, self.stats
        self.cut = False
        skipped = 0
        while order:
            member = next(iter(order))
            if not _can_send(member, now):
                del order[member]
                skipped += 1
                if skipped >= SKIPS:
                    self.cut = True
                    return None
                continue
            size = len(member.pending[0].payload)
            stats.starved = stats.flying_records >= self.max_records or bool(
                stats.flying_records and stats.flying + size > self.max_bytes
            )
            if stats.starved:
                return None
            if member is not self.current:  # (a new turn)
                self.current, self.spent = member, 0
            return member
        stats.starved = False
        return None

    def served(self, member: Member, size: int, now: float) -> None:
        """`member` sent a record of `size` bytes: past `QUANTUM` in its turn, its next one
        waits for every other member's turn."""
        self.spent += size
        if not _can_send(member, now):
            self.order.pop(member, None)
        elif self.spent < QUANTUM and member is self.current:
            return  # (its turn goes on)
        elif member in self.order:
            self.order.move_to_end(member)
        else:
            self.order[member] = None
        self.current = None


def _can_send(member: Member, now: float) -> bool:
    return bool(
        member.pending
        and not member.window_full
        and member.failed is None
        and member.follows is None
        and member.retry_at <= now
    )


class Sender:
    """Sends the records of the members it is told of (`notify`) on the connection `link()`
    gives, while `connected` is set; `departed(member)` once a leaving member's last record
    is acknowledged; `everyone()` are the members with records in flight to watch."""

    def __init__(
        self,
        stats: RelayStats,
        connected: asyncio.Event,
        link: Callable[[], tuple[Client | None, AckInbox | None]],
        everyone: Callable[[], Iterable[Member]],
        departed: Callable[[Member], None],
        *,
        linger: float,
        publish_timeout: float,
        inflight_bytes: int = INFLIGHT_BYTES,
        inflight_records: int = INFLIGHT_RECORDS,
    ) -> None:
        self.stats = stats
        self.connected = connected
        self.link = link
        self.everyone = everyone
        self.departed = departed
        self.linger = linger
        self.publish_timeout = publish_timeout
        self.turns = Turns(stats, inflight_bytes, inflight_records)
        self._ready: dict[Member, None] = {}  # members with something to send or handle
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._retry: asyncio.TimerHandle | None = None  # wakes the sender for a retry

    def start(self) -> None:
        self._task = asyncio.create_task(self._send_loop(), name="kv-relay-sender")
        self._watch_acks()

    def stop(self) -> asyncio.Task[None] | None:
        """Stop the timers and cancel the task, returned to be awaited."""
        for timer in (self._watchdog, self._retry):
            if timer is not None:
                timer.cancel()
        if self._task is not None:
            self._task.cancel()
        return self._task

    def notify(self, member: Member) -> None:
        """`member` has something to do: records to send, a failure to handle..."""
        self._ready[member] = None
        if member.pending:  # its turn from now (one round behind the others' at most)
            self.turns.add(member)
        self._work.set()

    def resend(self, why: str) -> None:
        """Every member sends again what it has in flight (its answers may never come)."""
        for member in self.everyone():
            if member.inflight:
                member.failed = why
                self.notify(member)

    async def _send_loop(self) -> None:
        while True:
            await self._work.wait()
            if self.linger > 0:
                await asyncio.sleep(self.linger)
            await self.connected.wait()
            self._work.clear()
            ready, self._ready = self._ready, {}
            try:
                await self._send_round(ready)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: the sender must outlive it, or nothing is relayed
                log.exception("kv relay: sending failed; going on")
                for member in ready:
                    self.notify(member)
                await asyncio.sleep(1.0)

    async def _send_round(self, ready: dict[Member, None]) -> None:
        """Handle what the `ready` members have to do, then send records, the members taking
        turns, while the budget takes them (members ready meanwhile are handled as it goes)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        later = await self._handle(ready, now)
        turns = self.turns
        started = loop.time()
        while True:
            if loop.time() - started > YIELD_SECONDS:  # a backlog: others run meanwhile
                await asyncio.sleep(0)
                now = loop.time()
                if self._ready:  # (failures to handle, paused members to send again)
                    ready, self._ready = self._ready, {}
                    soon = await self._handle(ready, now)
                    later = soon if later is None or soon is None else min(later, soon)
                started = loop.time()
            member = turns.next(now)
            if member is None:
                if not turns.cut:
                    break  # (nothing to send, or the budget spent)
                started = -YIELD_SECONDS  # (yield, then look at the rest)
                continue
            if not self.connected.is_set():  # lost while this round yielded: when it is back
                self._work.set()
                break
            size = len(member.pending[0].payload)
            await self._send(member, now)
            turns.served(member, size, now)
            if member.failed is not None:
                self.notify(member)
        if later is not None and (self._retry is None or self._retry.when() > later):
            if self._retry is not None:
                self._retry.cancel()
            self._retry = loop.call_at(later, self._retry_now)

    async def _handle(self, ready: dict[Member, None], now: float) -> float | None:
        """A failure sent again, a pause, a `left` acknowledged; a turn for each member with
        a record to send. Returns when the first member paused may send again."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        later = None
        for member in ready:
            if loop.time() - started > YIELD_SECONDS:  # a backlog: others run meanwhile
                await asyncio.sleep(0)
                started = loop.time()
            if member.follows is not None:
                continue  # after the run before it (`departed` wakes it)
            if member.failed is not None:
                self._failed(member, now)
            if member.retry_at > now:
                self._ready[member] = None
                later = member.retry_at if later is None else min(later, member.retry_at)
                continue
            if member.pending and not member.window_full:
                self.turns.add(member)
            if member.leaving and not member.pending and not member.inflight:
                self.departed(member)
        return later

    def _retry_now(self) -> None:
        self._retry = None
        self._work.set()

    async def _send(self, member: Member, now: float) -> None:
        """Send the first record of the member's queue."""
        nc, acks = self.link()
        if nc is None or acks is None:  # (connecting again: `connected` is clear then)
            self.notify(member)
            return
        pending = member.pending
        record = pending[0]
        try:
            await nc.publish(
                member.subject,
                record.payload,
                reply=acks.reply(member, record),
                headers=record.headers(member),
            )
        except nats.errors.MaxPayloadError:
            acks.forget(record)
            # Larger than the server takes, ever: a loss, told as one.
            self.stats.publish_errors += 1
            self.stats.dropped += 1
            self.stats.resnapshots += 1
            log.warning(
                "kv relay: batch %d of instance %x is over NATS's max payload: "
                "published as a resnapshot", record.seq, member.instance_id,
            )  # fmt: skip
            if pending and pending[0] is record:
                member.replace_head(Record(layout.RESNAPSHOT, record.seq + 1, record.ts))
            return
        except Exception as exc:
            acks.forget(record)
            member.failed = f"not sent: {exc!r}"
            return
        record.sent = now
        member.sent(record)
        member.taken()

    def _failed(self, member: Member, now: float) -> None:
        """Put what is in flight back in the queue, to be sent again after a pause."""
        why = member.failed
        acks = self.link()[1]
        for record in member.rewind():
            if acks is not None:
                acks.forget(record)
        self.stats.publish_errors += 1
        log.debug("kv relay: publishing to %s: %s; sending again", member.subject, why)
        member.retry_at = now + member.delay
        member.delay = min(member.delay * 2, BACKOFF_MAX)

    def _watch_acks(self) -> None:
        """Every so often: a member whose oldest record in flight is not acknowledged in
        time sends again (its answer may never come)."""
        loop = asyncio.get_running_loop()
        timeout = self.publish_timeout
        self._watchdog = loop.call_later(min(timeout / 4, 1.0), self._watch_acks)
        now = loop.time()
        for member in self.everyone():
            if member.failed is None and member.expired(now, timeout):
                member.failed = f"no acknowledgement in {timeout} s"
                self.notify(member)
