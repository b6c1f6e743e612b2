"""Shared test helpers: waiting on conditions with a deadline, free ports, serving an aiohttp
app on one, and collecting what an async stream yields."""

from __future__ import annotations

import asyncio
import collections
import gc
import inspect
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

from aiohttp import web

T = TypeVar("T")


async def wait_for(
    condition: Callable[[], Any | Awaitable[Any]],
    timeout: float = 10.0,
    interval: float = 0.02,
    message: str = "",
) -> Any:
    """Poll `condition` until it returns a truthy value; fail with `message` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
            last = result
        except Exception as exc:
            last = exc
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(
                f"condition not met within {timeout}s: {message or condition} (last: {last!r})"
            )
        await asyncio.sleep(interval)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """Serves an aiohttp app on a 127.0.0.1 port; it can stop and start again on that port.

    The port is a free one chosen up front (so `url` is known before `start`), or with
    `port=0` the one the system picks at the first `start`. Handler cancellation is on, as in
    the worker: a client disconnect cancels the handler.
    """

    def __init__(self, app: web.Application, port: int | None = None) -> None:
        self.port = free_port() if port is None else port
        self._app = app
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._runner = web.AppRunner(self._app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        if self.port == 0:
            assert site._server is not None
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[Server]:
    """`app` served on a free port for the block."""
    server = Server(app)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class Collector(Generic[T]):
    """Runs an async stream (a watch) in a task and keeps what it yields, until `close`."""

    def __init__(self, stream: AsyncIterator[T]) -> None:
        self.events: list[T] = []
        self._stream = stream
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for event in self._stream:
            self.events.append(event)
            self._apply(event)

    def _apply(self, event: T) -> None:
        """What a subclass does with each event as it arrives."""

    def of(self, kind: type) -> list[T]:
        return [e for e in self.events if isinstance(e, kind)]

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class StallProbe:
    """Measures the longest time the event loop was held: a task that asks to wake every
    millisecond and records how late it woke. The hold is counted in this thread's CPU time,
    so a loaded machine that leaves the process waiting for a core does not count as work
    on the loop (the wall-clock figure is kept for the message)."""

    def __init__(self) -> None:
        self.longest = self.longest_wall = 0.0
        # What the test session allocated before (other tests' objects, in this xdist worker)
        # is left out of the collector's full passes while probing: a pass over that heap is
        # no work of the code under test. What the code allocates is collected as ever.
        gc.collect()
        gc.freeze()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            wall, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.001)
            self.longest = max(self.longest, time.thread_time() - cpu)
            self.longest_wall = max(self.longest_wall, time.perf_counter() - wall)

    async def stop(self) -> float:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        gc.unfreeze()
        return self.longest


class LoopTurns:
    """Counts the event loop's turns: a task that asks to run again at once, every turn.
    `note()` in a consumer records the turn each item arrived in; `most_per_turn` is the
    largest number of items one turn handled (what a consumer did without a yield)."""

    def __init__(self) -> None:
        self.count = 0
        self.per_turn: collections.Counter[int] = collections.Counter()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.count += 1

    def note(self) -> None:
        self.per_turn[self.count] += 1

    @property
    def most_per_turn(self) -> int:
        return max(self.per_turn.values(), default=0)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
