"""When a subscriber's subscription is in place at a `KvEventPublisher` (ZMQ's slow joiner).

A PUB socket sends a message only to the subscribers whose subscription it has: one that
connected a moment ago, whose subscription is still on its way, misses what is published
meanwhile (a lost batch, which only a later one shows). A test that publishes live right
after subscribing waits for the subscription to reach the publisher's socket, not for a
while: `start_seeing_subscribers` starts the publisher with an XPUB for its PUB socket
(libzmq's PUB is an XPUB that reads nothing: it publishes alike), and `subscribed` reads
from it the subscription that arrived, which the socket has applied when it hands it over.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from unittest import mock

import zmq
import zmq.asyncio

from shoal.kv import KvEndpoint
from shoal.worker.kv_publisher import KvEventPublisher


async def start_seeing_subscribers(publisher: KvEventPublisher) -> KvEndpoint:
    """`publisher.start()`, its PUB socket made an XPUB that hands over every subscription
    (`XPUB_VERBOSE`), with every option `start` sets on it."""
    real = zmq.asyncio.Context.socket

    def socket(ctx: zmq.asyncio.Context, kind: int, *args: Any, **kwargs: Any) -> Any:
        if kind != zmq.PUB:
            return real(ctx, kind, *args, **kwargs)
        sock = real(ctx, zmq.XPUB, *args, **kwargs)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        return sock

    # (`start` makes its sockets before its first await: no other task's socket is made so)
    with mock.patch.object(zmq.asyncio.Context, "socket", socket):
        endpoint = await publisher.start()
    assert publisher._pub is not None and publisher._pub.type == zmq.XPUB
    return endpoint


async def subscribed(publisher: KvEventPublisher, timeout: float = 10.0) -> None:
    """Until a subscription to `publisher`'s topic has reached its socket (one not waited for
    before): from then on, what it publishes reaches that subscriber while its queue has room."""
    sock = publisher._pub
    assert sock is not None and sock.type == zmq.XPUB, "start_seeing_subscribers first"
    await subscription_reached(sock, publisher.topic, timeout)


async def subscription_reached(sock: zmq.asyncio.Socket, topic: bytes, timeout: float) -> None:
    """Until the XPUB `sock` hands over a subscription to `topic` (`XPUB_VERBOSE`: each one)."""
    wanted = b"\x01" + topic
    deadline = time.monotonic() + timeout
    got: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        try:
            frame = await asyncio.wait_for(sock.recv(), max(left, 0.0))
        except TimeoutError:
            raise AssertionError(
                f"no subscription to {topic!r} reached the publisher within {timeout}s "
                f"(got: {got!r})"
            ) from None
        if frame == wanted:
            return
        got.append(frame)
