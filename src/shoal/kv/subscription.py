"""`KvSubscription`: one instance's KV event stream, handed on batch by batch in sequence order.

Per instance, one task reads the PUB socket the instance advertises and hands each batch, with
its sequence number, to `apply` in sequence order: the frontend's tracker applies it to the
indexes that track the instance (in slices of `APPLY_SLICE` blocks), the relay
(`shoal.relay`) publishes it whole to JetStream. One implementation for both, so both see
losses the same way. Sequence numbers make every loss visible:

- on connect, the whole buffered history is asked from the replay socket, so an instance
  that cached blocks before this frontend started is indexed at once;
- a batch whose number skips ahead (`gap`) triggers a replay of the missing range;
- when the missing range cannot be replayed (no replay socket, no answer, or the
  publisher no longer buffers it), the instance is resnapshotted: its blocks are dropped
  from every index and rebuilt from the events that follow. The index may forget blocks;
  it never keeps ones the instance no longer holds because an event was lost;
- a live batch numbered at or below the last one applied, other than the very batch that
  was just replayed (queued meanwhile), means the publisher restarted (a vLLM behind a sidecar, say): its
  cache is gone, so are its blocks here, and its numbering starts again.

Sockets are read without blocking, every message ready at one wake-up of the event loop
(`_Reader`): pyzmq's asyncio sockets take a future, a callback and flag arithmetic per
message, which was most of a relay's cost of receiving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio

from shoal.kv.events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEndpoint,
    KVEventBatch,
    decode_seq,
    encode_seq,
)
from shoal.kv.sliced import decode_batch_in_slices, decoded_at_once

log = logging.getLogger(__name__)

UNREADABLE_SAID_EVERY = 60.0  # seconds: an instance's unreadable batches, one log line per

REPLAY_TIMEOUT = 2.0  # seconds to wait for each message of a replay
YIELD_EVERY = 64  # messages read before yielding to the event loop
YIELD_SECONDS = 0.005  # or this long
# The largest batch decoded: decoding is one step on the event loop, and an engine step's
# events weigh far less (16,384 tokens of prefill: ~100 KB). A larger one is a loss like an
# unreadable one. (ZMQ's own MAXMSGSIZE would do it before reading, but libzmq 4.3 never
# reconnects a peer it dropped for it: the subscription would go deaf.)
MAX_BATCH_BYTES = 4 << 20  # (and `decode_batch` refuses over `MAX_BATCH_EVENTS` events)
APPLY_SLICE = 1024  # blocks of one batch applied before yielding to the event loop
FREE_SLICE = 1 << 16  # token ids and hashes of a batch applied freed before yielding
# Sockets of one context: a SUB per instance followed, a DEALER while one replays (libzmq's
# default, 1,023, was ~500 instances catching up at once: the rest failed, unseen).
MAX_SOCKETS = 65_536
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


def zmq_context() -> zmq.asyncio.Context:
    """The ZMQ context of a process's subscriptions (`MAX_SOCKETS` sockets)."""
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
    return ctx


class KvStats:
    """Counters every subscription adds to, shown on `/metrics`."""

    __slots__ = ("batches", "decode_errors", "events", "replays", "resnapshots", "stream_drops")

    def __init__(self) -> None:
        self.batches = 0
        self.events = 0
        self.replays = 0
        self.resnapshots = 0
        self.decode_errors = 0
        self.stream_drops = 0  # records nats-py dropped for the stream reader (read again)


class KvSubscription:
    """Reads one instance's events; `apply(seq, batch)` and `resnapshot()` act on what
    follows it (indexes, a stream). With `whole_batches`, `apply` gets each batch once, else
    in slices (several calls with the same `seq`).

    `room()`, when given, is awaited before each batch is applied: a consumer that cannot
    take more (a relay whose NATS is down) holds the subscription back instead of dropping
    batches. What it does not read meanwhile waits in the socket's queue, then in the
    worker's replay buffer (a gap, replayed when reading resumes): lost only when the worker
    no longer has it, and then told by `resnapshot()` as any loss."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        instance_id: int,
        endpoint: KvEndpoint,
        apply: Callable[[int, KVEventBatch], None],
        resnapshot: Callable[[], None],
        stats: KvStats,
        *,
        whole_batches: bool = False,
        room: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.room = room
        self.instance_id = instance_id
        self.endpoint = endpoint
        self.apply = apply
        self.resnapshot = resnapshot
        self.stats = stats
        self.whole_batches = whole_batches
        self.last_seq = -1  # the last batch applied
        self._replayed: dict[int, int] = {}  # seq -> payload hash, of batches just replayed
        self.replay_broken = False  # its replay endpoint cannot be used: follow without it
        self._unsaid = 0  # unreadable batches not logged since the last said
        self._quiet_until = 0.0  # (monotonic) the next unreadable batch logged from then
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"kv-events-{self.instance_id:x}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def run(self) -> None:
        try:
            reader = _Reader(self.ctx, zmq.SUB)
        except zmq.ZMQError as exc:  # (out of sockets or files): said, not left to the GC
            log.error("KV events of instance %x: no socket: %s", self.instance_id, exc)
            raise
        sub = reader.sock
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic.encode())
        try:
            sub.connect(self.endpoint.publisher)
        except zmq.ZMQError as exc:  # (endpoints are checked where they enter: not expected)
            log.warning("KV events of instance %x: cannot subscribe: %s", self.instance_id, exc)
            reader.close()
            return
        try:
            await self._catch_up(0, None)
            pace = Pace()
            while True:
                frames = reader.recv()
                if frames is None:
                    await reader.wait()
                    continue
                await pace.step()
                if len(frames) != 3:
                    self.stats.decode_errors += 1
                    continue
                try:
                    seq = decode_seq(frames[1])
                except ValueError:
                    self.stats.decode_errors += 1
                    continue
                if seq <= self.last_seq:
                    if self._replayed.get(seq) == hash(frames[2]):
                        continue  # the same batch, queued while it was being replayed
                    self._restarted()
                if (self.last_seq >= 0 and seq > self.last_seq + 1) or self.last_seq < 0 < seq:
                    await self._catch_up(self.last_seq + 1, seq)
                await self._apply(seq, frames[2])
                if self._replayed:
                    self._replayed.clear()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV events of instance %x: subscription failed", self.instance_id)
            raise
        finally:
            reader.close()

    async def _apply(self, seq: int, payload: bytes) -> None:
        if self.room is not None:
            await self.room()
        try:
            if len(payload) > MAX_BATCH_BYTES:
                raise msgspec.DecodeError(f"{len(payload)} bytes, over {MAX_BATCH_BYTES}")
            # (4 MiB of token ids: 30-90 ms of CPU in one call holding the GIL, whichever
            # thread made it: decoded in slices of bytes, events or elements, yielding between.)
            batch = await decode_batch_in_slices(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # A batch we cannot read is a loss like any other: the index must not drift.
            self.stats.decode_errors += 1
            self._say_unreadable(seq, exc)
            self._resnapshot()
        else:
            # One event can store a whole context's blocks: applied a slice at a time (one
            # event of 200,000 blocks held the loop ~0.2 s).
            parts = (batch,) if self.whole_batches else slices(batch)
            for i, part in enumerate(parts):
                if i:
                    await asyncio.sleep(0)
                self.apply(seq, part)
            self.stats.batches += 1
            self.stats.events += len(batch.events)
            if not self.whole_batches and not decoded_at_once(payload):
                await let_go(batch)  # (the relay's `apply` may keep its batch: not there)
        self.last_seq = seq

    def _say_unreadable(self, seq: int, exc: Exception) -> None:
        """Log an unreadable batch, at most one line a minute per instance (a hostile or
        broken publisher sends them as fast as it likes; the count is in `decode_errors`)."""
        now = time.monotonic()
        if now < self._quiet_until:
            self._unsaid += 1
            return
        more = f" ({self._unsaid} more since the last said)" if self._unsaid else ""
        log.warning(
            "KV events of instance %x: batch %d unreadable: %s%s", self.instance_id, seq, exc, more
        )
        self._unsaid, self._quiet_until = 0, now + UNREADABLE_SAID_EVERY

    def _restarted(self) -> None:
        log.info("KV events of instance %x: the publisher restarted", self.instance_id)
        self._resnapshot()
        self.last_seq = -1
        self._replayed.clear()

    def _resnapshot(self) -> None:
        self.stats.resnapshots += 1
        self.resnapshot()

    async def _catch_up(self, first: int, upto: int | None) -> None:
        """Replay batches `first`.. (before `upto`, when a live batch showed the gap);
        resnapshot when the gap is not filled."""
        if self.endpoint.replay and not self.replay_broken:
            await self._replay(first, upto)
        if upto is not None and self.last_seq != upto - 1:
            log.info(
                "KV events of instance %x: batches %d..%d lost, dropping its blocks",
                self.instance_id,
                self.last_seq + 1,
                upto - 1,
            )
            self._resnapshot()
            self.last_seq = upto - 1

    async def _replay(self, first: int, upto: int | None) -> None:
        """Apply the buffered batches from `first` on (before `upto`), as they arrive.

        Flow control from this side: whatever arrives in order is applied and kept; when
        the stream stalls or skips (a publisher dropped messages past its queue), the rest
        is asked again from the next batch wanted, as long as each round makes progress.
        A publisher that no longer buffers `first` replays from its oldest batch: the
        missing range is a loss (resnapshot), what follows is applied."""
        self.stats.replays += 1
        while True:
            before = self.last_seq
            complete = await self._replay_round(self.last_seq + 1 if before >= 0 else first, upto)
            if (
                complete
                or self.last_seq == before
                or (upto is not None and self.last_seq >= upto - 1)
            ):
                return

    async def _replay_round(self, first: int, upto: int | None) -> bool:
        """One replay request from `first`: True when it ended with the end marker (or
        reached `upto`), False when it stalled, skipped or failed."""
        reader = _Reader(self.ctx, zmq.DEALER)
        try:
            reader.sock.connect(self.endpoint.replay)
        except zmq.ZMQError as exc:
            self.replay_broken = True
            log.warning(
                "KV events of instance %x: replay endpoint %r unusable (%s): following "
                "without replay", self.instance_id, self.endpoint.replay, exc,
            )  # fmt: skip
            reader.close()
            return True
        pace = Pace()
        received = False
        try:
            reader.sock.send_multipart((b"", encode_seq(first)), _NOBLOCK)
            while True:
                frames = reader.recv()
                if frames is None:
                    if not await reader.wait(REPLAY_TIMEOUT):
                        return False
                    continue
                await pace.step()
                if len(frames) < 2 or frames[-2] == END_OF_REPLAY or not frames[-1]:
                    return True
                seq, payload = decode_seq(frames[-2]), frames[-1]
                if seq <= self.last_seq:
                    continue
                if upto is not None and seq >= upto:
                    return True  # the live batch that showed the gap follows
                if self.last_seq >= 0 and seq != self.last_seq + 1:
                    if received:  # a hole in this round: ask again from the next one
                        return False
                    log.info(
                        "KV events of instance %x: batches %d..%d no longer buffered, "
                        "dropping its blocks", self.instance_id, self.last_seq + 1, seq - 1,
                    )  # fmt: skip
                    self._resnapshot()
                received = True
                await self._apply(seq, payload)
                self._replayed[seq] = hash(payload)
        except (ValueError, zmq.Again):
            return False
        finally:
            reader.close()


class _Reader:
    """A ZMQ socket read without blocking: `recv()` takes the next message ready (None when
    there is none), `wait()` sleeps until one is, woken by the socket's FD on the event loop.
    A task drains every message ready per wake-up, at the cost of one call each."""

    __slots__ = ("fd", "loop", "sock", "waiter")

    def __init__(self, ctx: zmq.Context[Any], kind: int) -> None:
        self.sock: zmq.Socket[bytes] = ctx.socket(kind, socket_class=zmq.Socket)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.loop = asyncio.get_running_loop()
        self.waiter: asyncio.Future[bool] | None = None
        self.fd: int = self.sock.get(zmq.FD)
        self.loop.add_reader(self.fd, self._signalled)

    def _signalled(self) -> None:
        # Reading EVENTS also takes the FD's signal down: read it whether a task waits or not.
        ready = cast(int, self.sock.get(_EVENTS)) & _POLLIN
        waiter = self.waiter
        if ready and waiter is not None and not waiter.done():
            waiter.set_result(True)

    def recv(self) -> list[bytes] | None:
        # EVENTS first: cheaper than the exception a read of an empty socket raises, and it
        # takes the FD's signal down, so a message arriving after this one signals it again.
        if not cast(int, self.sock.get(_EVENTS)) & _POLLIN:
            return None
        sock = self.sock
        try:
            frames = [sock.recv(_NOBLOCK)]
            while sock.get(_RCVMORE):  # (pyzmq's recv_multipart: enum arithmetic per frame)
                frames.append(sock.recv(_NOBLOCK))
        except zmq.Again:
            return None
        return frames

    async def wait(self, timeout: float | None = None) -> bool:
        """After `recv()` found nothing: until a message is ready (True) or `timeout` seconds
        passed (False)."""
        self.waiter = waiter = self.loop.create_future()
        timer = None if timeout is None else self.loop.call_later(timeout, _expire, waiter)
        try:
            ready: bool = await waiter
            return ready
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def close(self) -> None:
        self.loop.remove_reader(self.fd)
        self.sock.close(0)


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


async def let_go(batch: KVEventBatch) -> None:
    """Free the events of `batch`, applied, a slice of `FREE_SLICE` token ids and hashes at a
    time, yielding between (a decoded 4 MB batch freed at once held the loop 6-10 ms: a
    million ints), an event's own arrays a slice at a time when it holds more. `batch` is left
    empty: only for a batch no one else holds."""
    events = batch.events
    while events:
        last = events[-1]
        if not isinstance(last, AllBlocksCleared):
            arrays: tuple[list[Any], ...] = (last.block_hashes, getattr(last, "token_ids", []))
            if sum(map(len, arrays)) > FREE_SLICE:
                del max(arrays, key=len)[-FREE_SLICE:]
                await asyncio.sleep(0)
                continue
        weight, cut = 0, len(events)
        while cut and weight < FREE_SLICE:
            cut -= 1
            event = events[cut]
            if not isinstance(event, AllBlocksCleared):
                weight += len(event.block_hashes) + len(getattr(event, "token_ids", ()))
        del events[cut:]
        if events:
            await asyncio.sleep(0)


def slices(batch: KVEventBatch, limit: int = APPLY_SLICE) -> Iterator[KVEventBatch]:
    """`batch` as batches of about `limit` blocks each, in order and to the same effect: an
    event over `limit` blocks is cut in parts, each stored part chained to the last block
    of the part before (as the whole event chains them)."""
    part: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    size = 0
    for event in batch.events:
        for piece in _pieces(event, limit):
            part.append(piece)
            # (every event counts: 250,000 of no block were applied in one slice)
            size += 1 if isinstance(piece, AllBlocksCleared) else max(1, len(piece.block_hashes))
            if size >= limit:
                yield KVEventBatch(batch.ts, part, batch.data_parallel_rank)
                part, size = [], 0
    if part or not batch.events:
        yield KVEventBatch(batch.ts, part, batch.data_parallel_rank)


def _pieces(
    event: BlockStored | BlockRemoved | AllBlocksCleared, limit: int
) -> Iterator[BlockStored | BlockRemoved | AllBlocksCleared]:
    if isinstance(event, AllBlocksCleared) or len(event.block_hashes) <= limit:
        yield event
        return
    hashes = event.block_hashes
    if isinstance(event, BlockRemoved):
        for start in range(0, len(hashes), limit):
            yield BlockRemoved(hashes[start : start + limit], event.medium)
        return
    size = event.block_size
    if size <= 0 or len(event.token_ids) < size * len(hashes):
        yield event  # malformed: the index refuses it whole
        return
    for start in range(0, len(hashes), limit):
        yield BlockStored(
            hashes[start : start + limit],
            event.parent_block_hash if start == 0 else hashes[start - 1],
            event.token_ids[start * size : (start + limit) * size],
            size,
            event.lora_id,
            event.medium,
        )


class Pace:
    """Yields to the event loop every `YIELD_EVERY` messages or `YIELD_SECONDS`: a socket
    with messages queued returns them without ever suspending the task reading them."""

    __slots__ = ("count", "since")

    def __init__(self) -> None:
        self.count = 0
        self.since = time.monotonic()

    async def step(self) -> None:
        self.count += 1
        if self.count >= YIELD_EVERY or time.monotonic() - self.since > YIELD_SECONDS:
            await asyncio.sleep(0)
            self.count = 0
            self.since = time.monotonic()
