"""The worker's aiohttp servers (request ports, status server) with bounded connections.

aiohttp's own defaults keep a connection that sends nothing for an hour (keep-alive
3,630 s) and take any number of them: 1,100 silent connections used up a 1,024-fd worker,
whose chats then failed. Here a server holds:

- `max_connections` connections at most: a connection beyond it is answered
  `503 too_many_connections` (OpenAI format, `Connection: close`) and closed at once;
- a request's head: it must arrive within `HEAD_TIMEOUT` seconds of the connection's start,
  or of its first byte after a keep-alive wait, else the connection is closed silently;
- an idle keep-alive connection: closed after `KEEPALIVE_TIMEOUT` seconds.

`start_server(app, host, port, ...)` serves `app` so; `runner.addresses` names the port.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from shoal.openai import ApiError

KEEPALIVE_TIMEOUT = 75.0
"""Seconds an idle keep-alive connection is kept (as the frontend's, nginx's)."""
HEAD_TIMEOUT = 15.0
"""Seconds a request's head may take from the connection's start (or its first byte)."""
STATUS_MAX_CONNECTIONS = 128
"""Connections the status server holds at once: probes, scrapes and metadata fetches."""


def request_port_max_connections() -> int:
    """Connections a request port holds at once: half the process's file-descriptor limit
    (a sidecar opens one upstream connection per request too), at least 64, at most 10,000."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(64, min(10_000, soft // 2))


def _refusal(limit: int) -> bytes:
    error = ApiError(
        503,
        f"The worker already holds its limit of {limit} connections on this port; retry shortly.",
        type="service_unavailable_error",
        code="too_many_connections",
    )
    body = error.body()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _Refuse(asyncio.Protocol):
    """A connection over the limit: the 503 written, then closed."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.WriteTransport, transport)  # (uvloop's is no asyncio subclass)
        writer.write(self._answer)
        writer.close()


class _HeadTimedHandler(RequestHandler):
    """aiohttp's handler, closing a connection whose request head does not arrive in time."""

    __slots__ = ("_head_timeout", "_head_timer", "_heads_at_arm")

    def __init__(self, manager: web.Server, *, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout = head_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._heads_at_arm = 0

    def _waiting_for_head(self) -> bool:
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._heads_at_arm = self._request_count
        self._head_timer = self._loop.call_later(self._head_timeout, self._head_due)

    def _head_due(self) -> None:
        self._head_timer = None
        if self._request_count == self._heads_at_arm and self._waiting_for_head():
            self.force_close()  # (no head came in time: nothing to answer)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()  # a new connection: its first head, from its start

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # The first bytes of a head after a keep-alive wait (no timer, or one armed for a
        # head that came since): it has the head timeout from now.
        if (
            self._waiting_for_head()
            and not self._force_close
            and (self._head_timer is None or self._heads_at_arm != self._request_count)
        ):
            self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


class BoundedServer(web.Server):
    """`web.Server` holding at most `max_connections` connections, heads timed."""

    def __init__(
        self, *args: Any, max_connections: int, head_timeout: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self.open = 0  # connections made and not yet lost
        self.refused = 0
        self._answer = _refusal(max_connections)

    def __call__(self) -> Any:  # a RequestHandler, or a refusal past the limit
        if self.open >= self.max_connections:
            self.refused += 1
            return _Refuse(self._answer)
        self.open += 1  # (counted here: accepts of one loop turn all see it)
        return _HeadTimedHandler(
            self, loop=self._loop, head_timeout=self.head_timeout, **self._kwargs
        )

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self.open -= 1
        super().connection_lost(handler, exc)


class BoundedRunner(web.AppRunner):
    """`web.AppRunner` whose server is a `BoundedServer`."""

    def __init__(
        self,
        app: web.Application,
        *,
        max_connections: int,
        head_timeout: float | None = None,
        keepalive_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        keepalive = KEEPALIVE_TIMEOUT if keepalive_timeout is None else keepalive_timeout
        super().__init__(app, keepalive_timeout=keepalive, **kwargs)
        self._max_connections = max_connections
        self._head_timeout = HEAD_TIMEOUT if head_timeout is None else head_timeout

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return BoundedServer(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=asyncio.get_running_loop(),
            max_connections=self._max_connections,
            head_timeout=self._head_timeout,
            **made._kwargs,
        )


async def start_server(
    app: web.Application, host: str, port: int, *, max_connections: int, **kwargs: Any
) -> BoundedRunner:
    """Serve `app` on host:port (0: a free port) with the bounds above; `kwargs` go to the
    runner (`handler_cancellation`, `access_log`, `shutdown_timeout`, `head_timeout`...)."""
    runner = BoundedRunner(app, max_connections=max_connections, **kwargs)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
