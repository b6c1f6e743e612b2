"""When a subscriber's subscription is in place at a `KvEventPublisher` (ZMQ's slow joiner).

A publishing socket sends a message only to the subscribers whose subscription it has: one
that connected a moment ago, whose subscription is still on its way, misses what is published
meanwhile (a lost batch, which only a later one shows). A test that publishes live right
after subscribing waits for the subscription to reach the publisher's socket, not for a
while: the publisher takes each subscription itself and counts it (`subscriptions`), and
`subscribed` waits for the count; `subscription_reached` reads one from an XPUB made
verbose (a fake vLLM's). `raw_subscriptions` is a peer sending subscriptions and nothing
else, as an attacker would."""

from __future__ import annotations

import asyncio
import time
import weakref

import zmq
import zmq.asyncio

from shoal.kv import KvEndpoint
from shoal.worker.kv_publisher import KvEventPublisher


async def start_seeing_subscribers(publisher: KvEventPublisher) -> KvEndpoint:
    """`publisher.start()`: its socket takes every subscription itself and counts it
    (`subscriptions`), which `subscribed` waits for."""
    return await publisher.start()


_waited: weakref.WeakKeyDictionary[KvEventPublisher, int] = weakref.WeakKeyDictionary()


async def subscribed(publisher: KvEventPublisher, timeout: float = 10.0) -> None:
    """Until a subscription has reached `publisher`'s socket (one not waited for before): from
    then on, what it publishes reaches that subscriber while its queue has room."""
    wanted = _waited.get(publisher, 0) + 1
    deadline = time.monotonic() + timeout
    while publisher.subscriptions < wanted:
        if time.monotonic() > deadline:
            raise AssertionError(f"no subscription reached the publisher within {timeout}s")
        await asyncio.sleep(0.005)
    _waited[publisher] = wanted


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


async def raw_subscriptions(endpoint: str, topics: list[bytes]) -> asyncio.StreamWriter:
    """Connect to the PUB/XPUB socket at `endpoint` ("tcp://host:port") as a bare ZMTP 3.0 SUB
    peer and send a subscription to each of `topics`, holding no state of its own (a libzmq
    SUB or XSUB keeps its subscriptions too, at the same cost as the publisher); the writer,
    to close (the publisher may have closed it already)."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    mechanism = b"NULL".ljust(20, b"\0")
    writer.write(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + mechanism + b"\0" + b"\0" * 31)
    await reader.readexactly(64)  # the publisher's greeting
    ready = b"\x05READY" + b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB"
    writer.write(b"\x04" + bytes([len(ready)]) + ready)
    for topic in topics:
        body = b"\x01" + topic
        if len(body) < 256:
            writer.write(b"\x00" + bytes([len(body)]) + body)
        else:
            writer.write(b"\x02" + len(body).to_bytes(8, "big") + body)
        try:
            await writer.drain()
        except ConnectionError:  # (the publisher closed the connection)
            break
    return writer
