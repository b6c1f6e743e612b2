"""Shared test helpers: waiting on conditions with a deadline (and for the timers due within
a while, to see that something did not happen), free ports, serving an aiohttp app on one,
collecting what an async stream yields, and counting the work done per turn of the event
loop (`LoopTurns`: how long a turn holds the loop, counted, not timed)."""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import random
import socket
import threading
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


async def turns_until(condition: Callable[[], Any], most: int = 10_000) -> int:
    """Let the event loop turn, one turn at a time, until `condition()` holds; fail after
    `most` turns. For a state that lasts a turn or two (a task between two slices of its
    work), which a poll every few milliseconds would miss, and that a count of turns taken
    on trust would miss when the task takes one more step to get there. Returns the turns."""
    for turns in range(most + 1):
        if condition():
            return turns
        await asyncio.sleep(0)  # (one turn of the loop: the unit counted here)
    raise AssertionError(f"condition not met within {most} turns of the loop: {condition}")


async def timers_due_within(seconds: float) -> None:
    """Return once every timer of the running loop due within `seconds` from now has run.

    For a check that something a timer would do did NOT happen: a timer of ours, due after
    them, runs after them, as the loop runs its due timers in order of time however late it
    runs (on a loaded machine too), so the wait is as strong as it can be and as short as the
    period of the timer in question, not a guessed while."""
    loop = asyncio.get_running_loop()
    marker: asyncio.Future[None] = loop.create_future()
    handle = loop.call_at(loop.time() + seconds, _set_unless_done, marker)
    try:
        await marker
    finally:
        handle.cancel()


def _set_unless_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# Below Linux's ephemeral range (32768-60999): a port the system hands out for a bind to 0
# or an outgoing connection's end may be taken between `free_port` and a server's bind, or
# while a server stopped for an outage is down ("bind: address already in use" for etcd).
_SERVER_PORTS = range(20_000, 32_768)
_pick = random.SystemRandom()  # (not `random`: pytest-randomly seeds it alike in every worker)


async def refused_past(
    host: str, port: int, held: int
) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """Hold `held` connections to a bounded server and open one more: that one must be
    answered 503 `too_many_connections` and closed. The held ones are returned (the caller
    closes them)."""
    kept = [await asyncio.open_connection(host, port) for _ in range(held)]
    try:
        reader, writer = await asyncio.open_connection(host, port)
        answer = await asyncio.wait_for(reader.read(), 10)  # to the close
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"too_many_connections" in answer, answer
    except BaseException:
        for _, kept_writer in kept:
            kept_writer.close()
        raise
    return kept


def errors_logged(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    """The ERROR records of a test's `caplog`, less one kind that is another test's: an
    `openai` client left open by an earlier test, closed by the garbage collector during
    this one, logs "Task exception was never retrieved" (its loop is closed) on this loop."""
    return [
        r
        for r in records
        if r.levelname == "ERROR"
        and not (
            r.name == "asyncio" and "Event loop is closed" in str(r.getMessage()) + str(r.exc_info)
        )
    ]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the ephemeral range."""
    for _ in range(200):
        port = _pick.choice(_SERVER_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # (every pick taken: whatever the system gives)
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


class LoopTurns:
    """Counts the work done per turn of the event loop: a turn is one pass of the loop (its
    wait for I/O, then every callback ready: what runs without a yield between, one hold of
    the loop). `note(units)` in a consumer, or each call of a function `wrap` replaced, adds
    work to the turn it runs in; `most_per_turn` is the most work one turn did: the loop's
    hold, counted, not timed. Work done in another thread is not the loop's: it counts in
    `off_loop`, and its threads in `threads`. `stop()` puts back what `wrap` replaced."""

    def __init__(self) -> None:
        self.per_turn: collections.Counter[int] = collections.Counter()
        self.off_loop = 0
        self.threads: set[int] = set()  # the threads other than the loop's that did work
        self.loop_thread = threading.get_ident()
        self._turns = _turns_of(asyncio.get_running_loop())
        self._replaced: list[tuple[Any, str, Any]] = []

    @property
    def count(self) -> int:
        """The loop's turns so far (any thread may read it)."""
        return self._turns[0]

    def note(self, units: int = 1) -> None:
        thread = threading.get_ident()
        if thread == self.loop_thread:
            self.per_turn[self._turns[0]] += units
        else:
            self.off_loop += units
            self.threads.add(thread)

    def wrap(self, owner: Any, name: str, units: Callable[..., int] | None = None) -> LoopTurns:
        """Count every call of `owner.name` (a function, method or a module's global): as
        `units(*args, **kwargs)` of work, else one."""
        real = getattr(owner, name)
        self._replaced.append((owner, name, vars(owner).get(name, _ABSENT)))

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.note(1 if units is None else units(*args, **kwargs))
            return real(*args, **kwargs)

        setattr(owner, name, counted)
        return self

    @property
    def most_per_turn(self) -> int:
        return max(self.per_turn.values(), default=0)

    @property
    def on_loop(self) -> int:
        """The work done on the loop's thread, in all."""
        return sum(self.per_turn.values())

    async def stop(self) -> None:
        while self._replaced:
            owner, name, was = self._replaced.pop()
            if was is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, was)


_ABSENT = object()


def _turns_of(loop: asyncio.AbstractEventLoop) -> list[int]:
    """The turns `loop` made since they were first asked for: its `_run_once` (asyncio's
    pass of the loop) counts them, from then on, for as long as the loop runs."""
    turns: list[int] | None = getattr(loop, "_counted_turns", None)
    if turns is None:
        turns = [0]
        run_once = loop._run_once  # type: ignore[attr-defined]

        def counted() -> None:
            turns[0] += 1
            run_once()

        loop._run_once = counted  # type: ignore[attr-defined]
        loop._counted_turns = turns  # type: ignore[attr-defined]
    return turns
