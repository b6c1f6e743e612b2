"""`KvStreamReader`: the frontend's KV events from the relay's JetStream stream (`--kv-events
nats://...`), instead of one ZMQ subscription per worker.

One ordered consumer reads the stream's retained history, then live records (layout:
`shoal.kv.stream`). Per instance (namespace, instance id) it keeps the worker's number and
timestamp of the last batch applied, and checks every record the way `KvSubscription` checks
a worker's own numbering:

- a batch numbered at or below the last one and not newer is one already applied (another
  relay's copy): skipped;
- the next batch (numbered one more, not older) is applied; any other (a gap, the numbering
  started again by a restarted publisher, later) drops what the index holds of the instance
  before it is applied; so does a batch that cannot be read, and a `resnapshot` record unless
  it is for batches this reader did get (another relay delivered them): the index may forget
  blocks, never keep evicted ones;
- the records of an instance no `follow` asked for yet (the registry has not verified its
  card, or routes elsewhere) are kept as they came (their payload, decoded when applied), at
  most `PENDING_BATCHES` of them from its last loss on, `PENDING_BYTES` for all instances
  (each counted as its payload and `KEPT_COST` for the objects keeping it, `kept.Ledger`: older ones leave
  first, forgetting is safe, and an instance left with none and not followed is forgotten
  too), and applied when it is followed, so a frontend started late is caught up from the
  stream; a `left` record drops them (one that comes while the instance is followed is
  remembered: it is forgotten when the registry unfollows it); at most `MAX_UNFOLLOWED`
  instances not followed are known (their batches and place in the stream), the one read
  least recently forgotten past it;
- a large batch is applied in slices of `APPLY_SLICE` blocks, yielding between them, and a
  payload over `DECODE_SLICE_BYTES` or `DECODE_SLICE_EVENTS` events is decoded in slices of
  events (one event over the bytes, a slice of its arrays' elements at a time), and freed in
  slices once applied (`let_go`), as a subscription does (all by the instance's
  flush task, so its batches are applied in the order they came); an instance whose queue
  of batches to apply fills up is resnapshotted.

nats-py's queue of records read ahead holds `READ_AHEAD_BYTES` and `READ_AHEAD_MSGS` at most;
records it drops past that (a slow consumer) are counted (`stream_drops`), logged, and read
again from the first one dropped, once those before it are read. A reader that gets past
records the stream no longer holds (removed by retention before it read them: after a
reconnection, or once nats-py made its ordered consumer again) has lost some: every instance followed is dropped and rebuilt from what follows. So with a stream deleted and
made again (numbered from 1; a NATS server back without its storage), seen when the reader
connects and every `STREAM_CHECK` seconds: it is read from its start. NATS unreachable: retried
with backoff, the index kept as it is meanwhile; `connected` and `error` (`/health`) follow
nats-py's callbacks, so they say so at once, and each error is logged once per outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

import msgspec

from shoal.frontend.kv.kept import Instance, Ledger, StreamKey
from shoal.kv import AllBlocksCleared, KVEventBatch, decode_batch
from shoal.kv import stream as layout
from shoal.kv.sliced import decode_batch_in_slices, decoded_at_once
from shoal.kv.subscription import (
    APPLY_SLICE,
    MAX_BATCH_BYTES,
    KvStats,
    Pace,
    let_go,
    slices,
)

if TYPE_CHECKING:  # (nats is imported when a stream is first read: most frontends read none)
    from nats.aio.client import Client
    from nats.js import JetStreamContext, api

log = logging.getLogger(__name__)

PENDING_BATCHES = 4096  # kept per instance not yet followed
PENDING_BYTES = 64 << 20  # bytes of the batches kept for all instances at once
MAX_UNFOLLOWED = 16_384  # instances not followed known at once (~400 bytes each, and batches)
STREAM_CHECK = 5.0  # seconds between two looks at the stream read (deleted, made again?)
LOSE_SLICE = 4096  # batches kept dropped per turn of the loop at a loss of every instance's
BACKOFF_MAX = 5.0
# nats-py's queue of records read and not handled here yet (its defaults: 524,288 records,
# 256 MiB): at most so many bytes of payload, and records (~720 bytes each besides)
READ_AHEAD_BYTES = 16 << 20
READ_AHEAD_MSGS = 16_384
DROPS_TOLD_EVERY = 10.0  # seconds between two warnings of records dropped


def _blocks(batch: KVEventBatch) -> int:
    return sum(len(e.block_hashes) for e in batch.events if not isinstance(e, AllBlocksCleared))


class KvStreamReader:
    """Reads the stream; `follow(key, apply, purge)` routes one instance's batches."""

    def __init__(
        self, url: str, stream: str = layout.DEFAULT_STREAM, stats: KvStats | None = None
    ) -> None:
        self.urls = [u for u in url.split(",") if u]
        self.stream = stream
        self.stats = stats or KvStats()
        self.instances: dict[StreamKey, Instance] = {}
        self.unfollowed: dict[StreamKey, None] = {}  # those not followed, read least recently first
        self.ledger = Ledger()  # the batches kept, of every instance
        self.last_stream_seq = 0  # the stream sequence of the last record read
        self.connected = False
        self.error: str | None = None
        self._told: set[str] = set()  # the errors logged since the last connection
        self._task: asyncio.Task[None] | None = None
        self._created: datetime | None = None  # when the stream read was made
        self._js: JetStreamContext | None = None
        self._sub: JetStreamContext.PushSubscription | None = None  # the consumer read now
        self._dropped: int | None = None  # the first record nats-py dropped of it
        self._stopping: asyncio.Task[None] | None = None  # and its consumer being deleted
        self._drops_told = -DROPS_TOLD_EVERY  # when dropped records were last logged
        self._delay = 0.1  # before connecting again

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-stream")

    async def close(self) -> None:
        tasks = [t for t in (self._task,) if t is not None]
        tasks += [i.flushing for i in self.instances.values() if i.flushing is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    def describe(self) -> dict[str, object]:
        """For `/health`: the stream read, whether it is, and why not."""
        return {
            "stream": self.stream,
            "connected": self.connected,
            "error": self.error,
            "last_record": self.last_stream_seq,
            "instances": len(self.instances),
            "kept_bytes": self.ledger.bytes,
        }

    # -- the tracker's side -------------------------------------------------------------------

    def follow(
        self, key: StreamKey, apply: Callable[[KVEventBatch], None], purge: Callable[[], None]
    ) -> None:
        """Send `key`'s batches to `apply` (those kept so far first, yielding as it goes)."""
        instance = self.instances.get(key)
        if instance is None:
            instance = self.instances[key] = Instance(self.ledger, key)
        self.unfollowed.pop(key, None)
        instance.apply, instance.purge = apply, purge
        if instance.pending:
            self._start_flush(instance)

    def unfollow(self, key: StreamKey) -> None:
        instance = self.instances.get(key)
        if instance is None:
            return
        if instance.flushing is not None:
            instance.flushing.cancel()
            instance.flushing = None
        instance.apply = instance.purge = None
        instance.clear()
        if instance.left:  # (its `left` came while it was followed)
            del self.instances[key]
        else:  # (its place in the stream kept: copies of batches applied are still skipped)
            self._not_followed(key)

    def _not_followed(self, key: StreamKey) -> None:
        """`key`, not followed, read now: past `MAX_UNFOLLOWED` such instances, the one read
        least recently is forgotten (its batches kept, safe to forget, and its place)."""
        unfollowed = self.unfollowed
        unfollowed.pop(key, None)
        unfollowed[key] = None
        while len(unfollowed) > MAX_UNFOLLOWED:
            self._forget(next(iter(unfollowed)))

    def _forget(self, key: StreamKey) -> None:
        """Forget `key`, not followed: its batches kept and its place in the stream."""
        instance = self.instances.pop(key, None)
        if instance is not None:
            instance.clear()
        self.unfollowed.pop(key, None)

    def _deliver(self, instance: Instance, payload: bytes) -> None:
        """Apply the batch now when it is small and nothing waits before it; else queue it
        for the instance's flush task, which applies it in slices, yielding between them
        (and decodes it in slices when it is more than one: `decoded_at_once`). Kept
        for an instance not followed, or behind others: its payload, decoded later."""
        if instance.apply is None:
            if len(instance.pending) >= PENDING_BATCHES:
                instance.take()  # nothing applied yet: forgetting the oldest is safe
            instance.keep(payload)
            self._trim()
            return
        batch = None
        if instance.flushing is None and decoded_at_once(payload):
            batch = self._decode(instance, payload)
            if batch is None:
                return
            if _blocks(batch) <= APPLY_SLICE:
                instance.apply(batch)
                return
        if len(instance.pending) >= PENDING_BATCHES:
            self._resnapshot(instance)  # applying does not keep up: a loss, told as one
        instance.keep(payload, batch)
        self._start_flush(instance)
        self._trim()

    def _decode(self, instance: Instance, payload: bytes) -> KVEventBatch | None:
        """The batch in `payload`; None for one that cannot be read (a loss: the instance
        is resnapshotted)."""
        try:
            return self._decoded(instance, decode_batch(payload))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self._decoded(instance, None)

    async def _batch(
        self, instance: Instance, payload: bytes, decoded: KVEventBatch | None
    ) -> KVEventBatch | None:
        """The batch of a `payload` taken by the flush task (`decoded`: kept decoded), as
        `_decode` gives it (those kept after it are kept on a loss): decoded in slices (`decode_batch_in_slices`), yielding between
        them (4 MiB of token ids: 30-120 ms of CPU in one call holding the GIL, so a thread
        would not spare the loop)."""
        if decoded is not None:
            return decoded
        try:
            return self._decoded(instance, await decode_batch_in_slices(payload), True)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self._decoded(instance, None, True)

    def _decoded(
        self, instance: Instance, batch: KVEventBatch | None, taken: bool = False
    ) -> KVEventBatch | None:
        """`batch` counted; None (unreadable) a loss: the instance is resnapshotted (the
        batches kept after it stay when it was `taken` by the flush task)."""
        if batch is None:
            self.stats.decode_errors += 1
            self._resnapshot(instance, after=taken)
            return None
        self.stats.events += len(batch.events)
        return batch

    def _trim(self) -> None:
        """Past `PENDING_BYTES` kept, the oldest batches kept go first: one not followed yet
        is forgotten (safe: nothing of it applied yet), one waiting to be applied is a loss
        (its instance resnapshotted)."""
        ledger = self.ledger
        order = ledger.order
        while ledger.bytes > PENDING_BYTES and order:
            number = next(iter(order))  # (the oldest kept of all)
            instance = self.instances.get(order[number][2])
            if instance is None:  # (never: an instance forgotten is cleared first)
                ledger.gone(number)
            elif instance.apply is None:
                instance.take()  # (the oldest kept of all: the first of its instance's)
                if not instance.pending:  # (its place is worth less than its entry's bytes)
                    self._forget(instance.key)
            else:
                self._resnapshot(instance)

    def _start_flush(self, instance: Instance) -> None:
        if instance.flushing is None:
            instance.flushing = asyncio.create_task(self._flush(instance), name="kv-stream-flush")

    async def _flush(self, instance: Instance) -> None:
        pace = Pace()
        try:
            while instance.pending and instance.apply is not None:
                (payload, decoded), losses = instance.take(), instance.losses
                batch = await self._batch(instance, payload, decoded)
                del payload  # (not held while the batch is applied)
                if batch is None:
                    continue  # (unreadable: the instance was resnapshotted)
                for i, part in enumerate(slices(batch)):
                    if i:
                        await asyncio.sleep(0)
                    if instance.apply is None or instance.losses != losses:
                        break  # dropped meanwhile: the rest of this batch is dropped too
                    instance.apply(part)
                del decoded
                await let_go(batch)  # (no one else holds it: its entry in the ledger let go)
                del batch
                await pace.step()
        finally:
            if instance.flushing is asyncio.current_task():  # (not a flush started since)
                instance.flushing = None

    # -- the stream ---------------------------------------------------------------------------

    async def _run(self) -> None:
        import nats

        while True:
            nc: Client | None = None
            try:
                nc = await nats.connect(
                    self.urls,
                    connect_timeout=2,
                    max_reconnect_attempts=-1,
                    disconnected_cb=self._disconnected,
                    reconnected_cb=self._reconnected,
                    error_cb=self._error,
                )
                js = nc.jetstream()
                # (nats-py's queue: two of the largest records the server takes fit, at least)
                read_ahead = max(READ_AHEAD_BYTES, 2 * nc.max_payload + 1)
                while await self._consume(js, read_ahead):
                    continue  # (records nats-py dropped, a stream made again: read again)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.connected = False
                why = str(exc) or type(exc).__name__
                if why != self.error:
                    log.warning("kv stream %s: %s; retrying", self.stream, why)
                self.error = why
            finally:
                if nc is not None:
                    self.connected = False  # (before its callbacks: this one is let go)
                    with contextlib.suppress(Exception):
                        await nc.close()
            await asyncio.sleep(self._delay)
            self._delay = min(self._delay * 2, BACKOFF_MAX)

    async def _consume(self, js: JetStreamContext, read_ahead: int) -> bool:
        """Read the stream with an ordered consumer from the record after the last one read;
        True to read it again (from the first record nats-py dropped, or a new stream's start)."""
        from nats.js import api

        if self._made_again(await js.stream_info(self.stream)):
            await self._lose_all()
        start = self.last_stream_seq + 1
        at = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start
        )
        sub = await js.subscribe(
            f"{layout.SUBJECT_PREFIX}.>",
            stream=self.stream,
            ordered_consumer=True,
            config=at if start > 1 else None,
            deliver_policy=None if start > 1 else api.DeliverPolicy.ALL,
            idle_heartbeat=2.0,
            pending_msgs_limit=READ_AHEAD_MSGS,
            pending_bytes_limit=read_ahead,
        )
        self._js, self._sub, self._dropped, self._delay = js, sub, None, 0.1
        self.connected, self.error = True, None
        self._told.clear()
        log.info("kv stream: reading %s from record %d", self.stream, start)
        reading = asyncio.ensure_future(self._read(sub, js))
        made_again = False
        try:  # the stream itself looked at now and then: deleted, made again?
            while not (await asyncio.wait({reading}, timeout=STREAM_CHECK))[0]:
                if made_again := self._made_again(await js.stream_info(self.stream)):
                    break  # read again from the new one's start
            else:
                reading.result()  # (its failure)
        finally:
            self._sub = None
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if made_again:  # (once nothing is read of the old one)
            await self._lose_all()
        return made_again or self._dropped is not None

    # nats-py's callbacks: the state shown follows the connection at once (nats-py reconnects
    # on its own, so the reading above only noticed with its next look at the stream), and
    # each change is logged once (its own error callback logged a traceback per attempt).

    async def _disconnected(self) -> None:
        if self.connected:
            self.connected, self.error = False, "disconnected from NATS; reconnecting"
            log.warning("kv stream %s: %s", self.stream, self.error)

    async def _reconnected(self) -> None:
        self.connected, self.error = True, None
        self._told.clear()
        log.info("kv stream %s: reconnected to NATS", self.stream)

    async def _error(self, exc: Exception) -> None:
        from nats.errors import SlowConsumerError

        if isinstance(exc, SlowConsumerError):  # (of the one subscription: the consumer)
            if self._sub is not None:
                self._slow(exc.reply)
            return
        why = str(exc) or type(exc).__name__
        if why not in self._told and len(self._told) < 16:  # (until connected again)
            self._told.add(why)
            log.warning("kv stream %s: %s", self.stream, why)
        if not self.connected:
            self.error = why

    def _slow(self, reply: str) -> None:
        """nats-py dropped the record acknowledged by `reply` (its queue full): counted, told
        (every `DROPS_TOLD_EVERY` s at most), its consumer stopped at the first (`_stop`), and
        read again from it once the records queued before it are read (`_read`)."""
        from nats.aio.msg import Msg

        if self._dropped is None:  # (the first: those after it come after it, in order)
            try:
                metadata = Msg(_client=None, reply=reply).metadata  # type: ignore[arg-type]
            except Exception:  # (not a record's: an answer of the JetStream API)
                return
            if metadata.stream != self.stream:
                return
            self._dropped = metadata.sequence.stream
            self._stopping = asyncio.create_task(self._stop(metadata.consumer))
        self.stats.stream_drops += 1
        now = asyncio.get_running_loop().time()
        if now - self._drops_told >= DROPS_TOLD_EVERY:
            self._drops_told = now
            log.warning(
                "kv stream %s: nats-py dropped records (slow consumer; %d so far): "
                "read again from record %d", self.stream, self.stats.stream_drops, self._dropped,
            )  # fmt: skip

    async def _stop(self, consumer: str) -> None:
        """The server sends no more of `consumer`'s records: nats-py would drop them all (its
        flow control answers as it drops: the rest of the stream came, 1.1 M drops for
        300,000 records), and they are read again from the first dropped."""
        with contextlib.suppress(Exception):  # (gone already, or the connection: as well)
            if self._js is not None:
                await self._js.delete_consumer(self.stream, consumer)

    async def _read(self, sub: JetStreamContext.PushSubscription, js: JetStreamContext) -> None:
        """Apply the records; return once every one before the first nats-py dropped is."""
        pace = Pace()
        async for msg in sub.messages:
            seq, last = msg.metadata.sequence.stream, self.last_stream_seq
            if self._dropped is not None and seq >= self._dropped:
                return  # (read again from the first dropped: nothing after it applied first)
            if last and seq > last + 1 and await self._gone(js, last + 1):
                # (read again after a reconnection, or by the ordered consumer made again
                # after a lost one: either starts at the first record the stream still has)
                log.info(
                    "kv stream: records %d..%d gone, dropping every instance's blocks",
                    last + 1,
                    seq - 1,
                )
                await self._lose_all()
            self.last_stream_seq = seq
            self.record(msg.subject, msg.headers or {}, msg.data)
            if self._dropped is not None and not sub.pending_msgs:
                return
            await pace.step()

    async def _gone(self, js: JetStreamContext, seq: int) -> bool:
        """Whether the stream no longer holds record `seq` (retention and purges remove
        records from its head; a skip over records still there is of other subjects)."""
        info = await js.stream_info(self.stream)
        return bool(info.state.first_seq > seq)

    def _made_again(self, info: api.StreamInfo) -> bool:
        """Whether the stream is not the one read so far (made again since: numbered from
        1); if so, it is to be read from its start, and what is held of every instance is
        to be dropped (`_lose_all`)."""
        created, self._created = self._created, info.created
        if self.last_stream_seq == 0 or (
            created == info.created and info.state.last_seq >= self.last_stream_seq
        ):
            return False
        log.info("kv stream: %s was made again: reading it from its start, dropping every "
                 "instance's blocks", self.stream)  # fmt: skip
        self.last_stream_seq = 0
        return True

    async def _lose_all(self) -> None:
        """Drop what is held of every instance, `LOSE_SLICE` batches kept a turn of the loop
        (64 MiB of tiny batches dropped at once held it 23-53 ms); no record is read meanwhile."""
        dropped = 0
        for instance in list(self.instances.values()):
            if dropped >= LOSE_SLICE:
                await asyncio.sleep(0)
                dropped = 0
            dropped += len(instance.pending)
            instance.lose()
            instance.last_seq = -1

    def record(self, subject: str, headers: dict[str, str], payload: bytes) -> None:
        """Apply one record of the stream."""
        key = layout.parse_subject(subject)
        kind = headers.get(layout.KIND)
        if key is None or kind not in layout.KINDS:
            self.stats.decode_errors += 1
            return
        if kind == layout.JOINED:
            return
        instance = self.instances.get(key)
        if kind == layout.LEFT:
            if instance is not None and instance.apply is None:
                self._forget(key)
            elif instance is not None:
                instance.left = True  # (the registry unfollows it soon: forgotten then)
            return
        if instance is None:
            instance = self.instances[key] = Instance(self.ledger, key)
        if instance.apply is None:
            self._not_followed(key)
        try:
            seq, ts = int(headers[layout.SEQ]), float(headers[layout.TS])
        except (KeyError, ValueError):
            self.stats.decode_errors += 1
            return
        instance.left = False  # (batches after a `left`: a run back under the same id)
        last, last_ts = instance.last_seq, instance.last_ts
        seen = last >= 0 and seq <= last and ts <= last_ts
        following = last >= 0 and seq == last + 1 and ts >= last_ts
        if kind == layout.RESNAPSHOT:
            if not (seen or following):  # else: lost by a relay, not by this reader
                self._resnapshot(instance)
                instance.last_seq, instance.last_ts = seq - 1, ts
            return
        if seen:
            return  # already applied
        if last >= 0 and not following:
            self._resnapshot(instance)
        instance.last_seq, instance.last_ts = seq, ts
        if len(payload) > MAX_BATCH_BYTES:
            self.stats.decode_errors += 1
            self._resnapshot(instance)
            return
        self.stats.batches += 1
        self._deliver(instance, bytes(payload))

    def _resnapshot(self, instance: Instance, after: bool = False) -> None:
        self.stats.resnapshots += 1
        instance.lose(after)
