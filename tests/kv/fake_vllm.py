"""A stand-in for vLLM's KV event publisher: a PUB socket sending `[topic, seq, payload]`
and a ROUTER replay socket answering `[b"", start]` with every kept `[b"", seq, payload]`
then `[b"", -1, b""]`, as vLLM's `ZmqEventPublisher` does. Tests choose which sequence
numbers go out live (to make gaps) and which the replay buffer still holds; `subscribed()`
waits for a subscriber's subscription to reach the PUB socket (an XPUB: it publishes alike),
before which what goes out live is not sent to that subscriber (ZMQ's slow joiner)."""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio

from tests.helpers import free_port
from tests.kv.subscribers import subscription_reached

END = (-1).to_bytes(8, "big", signed=True)


class FakeVllmPublisher:
    def __init__(self, topic: bytes = b"") -> None:
        self.topic = topic
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.router = self.ctx.socket(zmq.ROUTER)
        for sock in (self.pub, self.router):
            sock.setsockopt(zmq.LINGER, 0)
        self.pub_port = free_port()
        self.replay_port = free_port()
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.kept: dict[int, bytes] = {}  # what the replay buffer holds
        self.replay_requests: list[int] = []
        self.task = asyncio.create_task(self._serve())

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def subscribed(self, timeout: float = 10.0) -> None:
        """Until a subscription to this publisher's topic reached its socket (one not waited
        for before): from then on, what goes out live reaches that subscriber."""
        await subscription_reached(self.pub, self.topic, timeout)

    async def send(self, seq: int, payload: bytes, *, live: bool = True, keep: bool = True) -> None:
        if keep:
            self.kept[seq] = payload
        if live:
            await self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    async def _serve(self) -> None:
        while True:
            identity, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            self.replay_requests.append(first)
            for seq in sorted(s for s in self.kept if s >= first):
                await self.router.send_multipart(
                    (identity, b"", seq.to_bytes(8, "big"), self.kept[seq])
                )
            await self.router.send_multipart((identity, b"", END, b""))

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()
