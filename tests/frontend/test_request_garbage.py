"""A request leaves nothing for the garbage collector: every object the request path makes
is freed by its reference count when the request ends. Cycles (a `Forward` and the
`Migration` riding along it) kept a stream's objects, and its last packet, alive until the
next collection: the heap's top grew by each stream's size and was trimmed again, page
faults on every request (bench/request_path.py, mode `whole`), and more for the collector to
walk. Served through the frontend's real request path over fake transports
(`bench.request_path.Bench`), with the collector off while the requests run."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import Iterator

import pytest
from bench.request_path import Bench, Transport

from shoal.frontend.http.exchange import ConnectRefused
from shoal.frontend.http.server import HttpConnection
from shoal.frontend.http.upstream import Upstream, UpstreamConnection
from tests.frontend.support import shoal_cycles
from tests.helpers import free_port, wait_for

REQUESTS = 20


def alive() -> set[int]:
    return {id(o) for o in gc.get_objects()}


def cycles_since(before: set[int]) -> int:
    """The objects in reference cycles that were not alive at `before`: what the block made
    (an earlier test's, let go while it ran, its event loop and transports, are not)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sum(1 for o in gc.garbage if id(o) not in before)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("instances", [1, 2])
@pytest.mark.parametrize("mode", ["plain", "stream", "whole"])
async def test_a_request_leaves_no_cycle_for_the_collector(
    mode: str, instances: int, collector_off: None
) -> None:
    bench = Bench(chunks=16, instances=instances)
    bench.serve(mode, 2)  # (what the first requests make once: caches, the pool)
    gc.collect()
    before = alive()
    bench.serve(mode, REQUESTS)
    left = cycles_since(before)
    bench.check()
    assert left == 0, f"{REQUESTS} {mode} requests left {left} objects in cycles"


async def test_a_client_connection_that_closes_leaves_no_cycle(collector_off: None) -> None:
    """A client that sends one request per connection (`Connection: close`, a client
    without a pool, or one that left): each closed connection is freed by its reference
    count. Its parser calls the connection's methods, a cycle until the connection breaks it."""
    bench = Bench(chunks=16)

    def one_connection() -> None:
        bench.client = HttpConnection(bench.server)
        bench.client.connection_made(Transport())  # type: ignore[arg-type]
        bench.serve("plain", 1)
        bench.client.connection_lost(None)

    one_connection()
    gc.collect()
    before = alive()
    for _ in range(REQUESTS):
        one_connection()
    left = cycles_since(before)
    bench.check()
    assert left == 0, f"{REQUESTS} closed connections left {left} objects in cycles"


async def test_a_client_leaving_while_its_connect_is_under_way_leaves_no_cycle(
    collector_off: None,
) -> None:
    """The client goes away while the gateway opens a connection to the worker (none was
    idle): the connect is cancelled, and the request's objects freed by their counts."""
    bench = Bench(chunks=16)
    upstream, _, _ = bench.workers[0]
    upstream.idle.clear()  # (the next request connects)
    request = bench.requests["plain"]

    async def one_request() -> None:
        client = HttpConnection(bench.server)
        client.connection_made(Transport())  # type: ignore[arg-type]
        client.data_received(request)
        (connecting,) = connects()
        client.connection_lost(None)  # the client left: the connect is cancelled
        del connecting
        await wait_for(lambda: not connects(), message="the connect ended")

    await one_request()
    gc.collect()
    before = alive()
    for _ in range(REQUESTS):
        await one_request()
    left = cycles_since(before)
    stats = bench.proxy.metrics.models["bench-model"].requests
    assert set(stats) == {499} and upstream.in_flight == 0, (stats, upstream.in_flight)
    assert left == 0, f"{REQUESTS} requests left while connecting left {left} objects in cycles"


def connects() -> list[asyncio.Task[None]]:
    """The request path's connects under way (`Forward._connect`)."""
    current = asyncio.current_task()
    return [t for t in asyncio.all_tasks() if t is not current and "_connect" in repr(t.get_coro())]


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_a_connect_that_fails_or_is_cancelled_leaves_no_cycle() -> None:
    """A connection to an instance that refuses it, or whose connect is cancelled (the client
    left) at any step, is freed by its reference count. uvloop (`shoal frontend`'s loop)
    makes the connection before it connects, and tells it nothing (no `connection_lost`)
    when the connect fails or is cancelled: its parser, which holds its methods, and its
    transport, which holds it, were reference cycles, one per connect given up. (Counted
    over real sockets: shoal's objects only, see `shoal_cycles`.)"""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(128)  # (never accepted: the kernel completes the connects)
    host, port = listening.getsockname()
    refusing = Upstream(1, f"http://127.0.0.1:{free_port()}")
    accepting = Upstream(2, f"http://{host}:{port}")

    async def attempts() -> None:
        with pytest.raises(ConnectRefused):
            await refusing.connect()
        for turns in range(6):  # cancelled at each step of the connect, and once it is made
            connecting = asyncio.ensure_future(accepting.connect())
            for _ in range(turns):
                await asyncio.sleep(0)  # (a turn of the loop: the connect goes a step on)
            connecting.cancel()
            (made,) = await asyncio.gather(connecting, return_exceptions=True)
            if isinstance(made, UpstreamConnection):  # (it was done before it was cancelled)
                made.close()
                await wait_for(lambda m=made: m.transport is None, message="closed")  # type: ignore[misc]
            del connecting, made

    try:
        await attempts()
        with shoal_cycles() as left:
            for _ in range(REQUESTS // 4):
                await attempts()
    finally:
        listening.close()
    assert not left, f"connects given up left {left}"
