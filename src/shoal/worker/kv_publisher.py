"""`KvEventPublisher`: an engine's KV cache events on a ZMQ PUB socket, in vLLM's format.

Events recorded during one turn of the event loop go out as one `KVEventBatch` with the
next sequence number (one per batch, from 0, increasing by one). The last `buffer`
batches are kept, so a subscriber that missed some (or just connected) asks the replay
socket (ROUTER) for everything from a sequence number on and gets it, then the
end-of-replay marker, at the pace it reads them (nothing is dropped: a full socket queue
makes the replay wait). A subscriber asking for batches older than the buffer gets them
from the oldest one kept: the first number it gets shows what it missed.

`wire_format` `map` encodes the events as tagged maps (`shoal.kv.events`) for readers of
vLLM's newer form such as vllm-router; the default, `array`, is what shoal's frontend and
relay read.

Publishing never blocks the engine: the socket drops messages for a subscriber that does
not keep up (its next sequence number shows the gap).

The publishing socket is an XPUB that takes subscriptions itself (`XPUB_MANUAL`), since
libzmq keeps every subscription a peer sends, each at ~45 times its size (a tree of its
prefixes): 2,000 of 4 KB from anyone who reached the port grew the worker by ~370 MB. A
peer that asks for this publisher's topic (or a prefix of it) is subscribed to it; a
subscription is at most `PUB_MAX_INBOUND` bytes (a larger one disconnects its peer); and
after `MAX_STRAY_SUBSCRIPTIONS` subscriptions to topics this publisher never sends (no
subscriber that means to read asks for one) the socket is opened anew on the same port,
dropping what they cost: every subscriber reconnects, and replays what it missed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from typing import cast

import zmq
import zmq.asyncio

from shoal.kv import (
    END_OF_REPLAY,
    WIRE_FORMATS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEndpoint,
    KVEventBatch,
    encode_batch,
    encode_batch_map,
    encode_seq,
)
from shoal.worker.endpoint import advertised_host

log = logging.getLogger(__name__)

DEFAULT_BUFFER = 10_000  # batches kept for replay
MAX_REPLAYS = 16  # replays served at once
REPLAY_SEND_TIMEOUT = 10.0  # seconds a replay waits for its subscriber to read
YIELD_EVERY = 64  # replayed messages sent, or subscriptions taken, before yielding
REPLAY_STALL = 0.1
"""Seconds a replay's subscriber may read nothing before the replay gives its place to a new
request, when all `MAX_REPLAYS` are taken. Peers asking replays they never read held every
place for `REPLAY_SEND_TIMEOUT`, and a subscriber whose request is dropped gets no replay at
all (a loss: the instance's blocks are dropped); one whose replay is abandoned after progress
asks again from where it got to. A subscriber that reads empties a full queue in far less."""
RETRY_WAIT = 0.02
"""The longest wait between two tries of a send refused for a full queue (`zmq.Again`)."""
PUB_MAX_INBOUND = 256
"""The largest frame the publishing socket takes from a peer: a subscription (its topic; this
publisher's own is at most `PUB_MAX_INBOUND - 64` bytes), or the handshake's few dozen."""
MAX_STRAY_SUBSCRIPTIONS = 64
"""Subscriptions to topics never sent taken before the publishing socket is opened anew."""
MAX_MARKS = 256
"""Subscribers coming back after the publishing socket was opened anew sent the publisher's
next number at once (an empty batch when none is queued), at most: they replay what was
published while they were away."""
MAX_INBOUND_BYTES = 4096
"""The largest frame either socket takes from a peer (ZMQ_MAXMSGSIZE): a replay request is
a few bytes, a subscription its topic. A peer sending more is disconnected before it is
read (one 600 MB frame grew the worker by 600 MB)."""


class KvEventPublisher:
    """Publishes one engine's KV events; `start()` binds, `close()` unbinds."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        replay_port: int = 0,
        topic: str = "",
        buffer: int = DEFAULT_BUFFER,
        wire_format: str = "array",
    ) -> None:
        if wire_format not in WIRE_FORMATS:
            raise ValueError(f"wire_format must be one of {', '.join(WIRE_FORMATS)}")
        if len(topic.encode()) > PUB_MAX_INBOUND - 64:
            raise ValueError(f"topic must be at most {PUB_MAX_INBOUND - 64} bytes")
        self.wire_format = wire_format
        self._encode = encode_batch if wire_format == "array" else encode_batch_map
        self.host = host
        self.port = port
        self.replay_port = replay_port
        self.topic = topic.encode()
        self.next_seq = 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer)
        self.endpoint: KvEndpoint | None = None
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._flush: asyncio.Handle | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._subscription_task: asyncio.Task[None] | None = None
        self.subscriptions = 0  # subscription requests taken
        self.reopened = 0  # times the publishing socket was opened anew (stray subscriptions)
        self._subscribers = 0  # subscriptions to the topic taken by the socket now open
        self._marks = 0  # of those before the last reopen: each returning one gets a mark
        self._unseen = 0  # the first number published since the last reopen began
        self._last_events = -1  # the number of the last batch with events (not a mark)
        self._replays: set[asyncio.Task[None]] = set()
        self.waiting = 0  # replays waiting for their subscriber to read
        self._stalled: dict[asyncio.Task[None], float] = {}  # waiting replay -> since when

    async def start(self) -> KvEndpoint:
        """Bind both sockets (port 0: a free port) and serve replays; returns the endpoint."""
        self._ctx = ctx = zmq.asyncio.Context()
        self._pub = self._publishing_socket()
        self._replay = ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
        self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue waits, never drops
        pub_port = _bind(self._pub, self.host, self.port)
        replay_port = _bind(self._replay, self.host, self.replay_port)
        host = advertised_host(self.host)
        self.endpoint = KvEndpoint(
            publisher=f"tcp://{host}:{pub_port}",
            replay=f"tcp://{host}:{replay_port}",
            topic=self.topic.decode(),
        )
        self._replay_task = asyncio.create_task(self._serve_replays(), name="kv-replay")
        self._subscription_task = asyncio.create_task(
            self._serve_subscriptions(), name="kv-subscriptions"
        )
        return self.endpoint

    def _publishing_socket(self) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, PUB_MAX_INBOUND)  # (subscriptions come in)
        sock.setsockopt(zmq.XPUB_MANUAL, 1)  # (taken by `_serve_subscriptions`)
        return sock

    async def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self.flush()
        for task in (self._replay_task, self._subscription_task, *self._replays):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        self._pub = self._replay = self._ctx = None

    # -- recording --------------------------------------------------------------------------

    def record(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        """Queue `event` for the batch sent at the end of this event-loop turn."""
        if self._ctx is None:
            return
        self._pending.append(event)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self, mark: bool = False) -> None:
        """Send the queued events as one batch with the next sequence number (`mark`: even
        none, to show subscribers the last number)."""
        self._flush = None
        if not (self._pending or mark) or self._ctx is None:
            return
        if self._pending:
            self._last_events = self.next_seq
        batch = KVEventBatch(ts=time.time(), events=self._pending)
        self._pending = []
        seq, payload = self.next_seq, self._encode(batch)
        self.next_seq += 1
        self.buffer.append((seq, payload))
        if self._pub is None:  # (opened anew: subscribers get it by replay)
            return
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self.topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)

    # -- subscriptions --------------------------------------------------------------------------

    async def _serve_subscriptions(self) -> None:
        """Subscribe each peer that asks for this publisher's topic (or a prefix of it) to that
        topic (`XPUB_MANUAL`: a subscription applies to the peer of the message just read);
        count the others, and past `MAX_STRAY_SUBSCRIPTIONS` open the socket anew.
        Unsubscriptions are ignored: a peer's entry goes when it disconnects."""
        topic, stray = self.topic, 0
        while True:
            sock = self._pub
            assert sock is not None
            for _ in range(YIELD_EVERY):
                message = await sock.recv()
                if message[:1] != b"\x01":
                    continue
                self.subscriptions += 1
                if topic.startswith(message[1:]):
                    sock.setsockopt(zmq.SUBSCRIBE, topic)
                    self._subscribers += 1
                    if self._marks and self._last_events >= self._unseen:
                        self._marks -= 1
                        self.flush(mark=True)  # (sent to the peer just subscribed too)
                    continue
                stray += 1
                if stray > MAX_STRAY_SUBSCRIPTIONS:
                    await self._reopen(stray)
                    stray = 0
                    break
            await asyncio.sleep(0)

    async def _reopen(self, stray: int) -> None:
        """Close the publishing socket, with every subscription it keeps, and bind a new one
        on the same port (tried again until the port is free: what is published meanwhile
        is buffered, and replayed to the subscribers that reconnect)."""
        assert self._pub is not None and self.endpoint is not None
        log.warning(
            "KV events: %d subscriptions to topics this publisher never sends: its socket is "
            "opened anew (its subscribers reconnect and replay what they missed)",
            stray,
        )
        self._pub.close(0)
        self._pub = None
        self.reopened += 1
        # A batch published from now until a subscriber is back is not sent to it, and an
        # idle worker may send none after: each subscriber coming back (as many as there
        # were) is sent the next number at once (an empty batch when none is queued), so
        # it replays what it missed (only when batches with events were published since:
        # an idle worker opened anew again and again fills its buffer with no marks).
        if not self._marks:
            self._unseen = self.next_seq
        self._marks = min(self._marks + self._subscribers, MAX_MARKS)
        self._subscribers = 0
        port = int(self.endpoint.publisher.rsplit(":", 1)[1])
        pause = 0.005
        while True:
            sock = self._publishing_socket()
            try:
                sock.bind(f"tcp://{self.host}:{port}")
            except zmq.ZMQError:
                sock.close(0)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            self._pub = sock
            return

    # -- replay -------------------------------------------------------------------------------

    async def _serve_replays(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) < 3:
                continue  # not [identity, b"", start]
            if len(self._replays) >= MAX_REPLAYS and not self._make_room():
                continue  # too many at once, their subscribers reading: it asks again
            identity, start = frames[0], frames[-1]
            first = int.from_bytes(start, "big", signed=True) if len(start) == 8 else -1
            task = asyncio.create_task(self._replay_to(sock, identity, first))
            self._replays.add(task)
            task.add_done_callback(self._replays.discard)

    def _make_room(self) -> bool:
        """Abandon the replay whose subscriber has read nothing the longest, if for
        `REPLAY_STALL` seconds at least; whether one was."""
        if not self._stalled:
            return False
        task, since = min(self._stalled.items(), key=lambda item: item[1])
        stalled = asyncio.get_running_loop().time() - since
        if stalled < REPLAY_STALL:
            return False
        log.info(
            "KV replay abandoned: its subscriber read nothing for %.1fs, another asks", stalled
        )
        task.cancel()
        self._replays.discard(task)
        del self._stalled[task]
        return True

    async def _replay_to(self, sock: zmq.asyncio.Socket, identity: bytes, first: int) -> None:
        """Send one subscriber the batches from `first` on, then the end marker, at the pace
        it reads them: the socket refuses what its queue cannot hold (ROUTER_MANDATORY)
        and the send waits; a subscriber that reads nothing for `REPLAY_SEND_TIMEOUT`, or
        left, is dropped. Yields to the event loop every `YIELD_EVERY` messages."""
        batches = self.replay_from(first)
        try:
            for i, (seq, payload) in enumerate(batches):
                await self._send(sock, (identity, b"", encode_seq(seq), payload))
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    await asyncio.sleep(0)
            await self._send(sock, (identity, b"", END_OF_REPLAY, b""))
        except (zmq.ZMQError, TimeoutError) as exc:
            log.info(
                "KV replay from %d abandoned after its subscriber stalled or left: %s", first, exc
            )

    async def _send(self, sock: zmq.asyncio.Socket, frames: tuple[bytes, ...]) -> None:
        """Send `frames`, waiting (at most `REPLAY_SEND_TIMEOUT`) while the queue is full.

        With `ROUTER_MANDATORY` the socket counts as writable while any peer's queue has room,
        so pyzmq's send to a full one fails at once (`zmq.Again`) whenever another peer is
        connected, rather than waiting: it is tried again, at most `RETRY_WAIT` apart.
        Meanwhile the replay is stalled: `_make_room` may abandon it for a new request."""
        sent = cast("asyncio.Future[object]", sock.send_multipart(frames))
        if sent.done() and sent.exception() is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLAY_SEND_TIMEOUT
        pause = 0.001
        self.waiting += 1
        task = asyncio.current_task()
        if task is not None:
            self._stalled[task] = loop.time()  # type: ignore[index]
        try:
            while True:
                try:
                    await asyncio.wait_for(sent, max(0.0, deadline - loop.time()))
                    return
                except zmq.Again:
                    if loop.time() >= deadline:
                        raise TimeoutError(f"no room for {REPLAY_SEND_TIMEOUT:g}s") from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_WAIT)
                sent = cast("asyncio.Future[object]", sock.send_multipart(frames))
        finally:
            self.waiting -= 1
            if task is not None:
                self._stalled.pop(task, None)  # type: ignore[arg-type]

    def replay_from(self, first: int) -> list[tuple[int, bytes]]:
        """The buffered batches from `first` on; from the oldest one when `first` is older
        (the subscriber sees what it missed by the first sequence number it gets)."""
        buffer = self.buffer
        if not buffer or first > buffer[-1][0]:
            return []
        skip = max(0, first - buffer[0][0])
        return list(itertools.islice(buffer, skip, None))


def _bind(sock: zmq.asyncio.Socket, host: str, port: int) -> int:
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")
