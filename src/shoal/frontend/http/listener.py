"""`HttpServer`: the listening socket of the gateway's HTTP server, the one timer that
enforces every connection's deadlines, and the graceful close. Each accepted connection is an
`HttpConnection` (server.py); over TLS, under the loop's TLS layer, `Counted` from its accept.

A sweep checks the connections a slice of `TURN_SECONDS` at a time, the rest in the loop's
next turns (all against the time it began): 4,000 slow heads timing out at once, each
answered 408 in its check, held the loop ~150 ms in one callback.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import ssl
import time
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import uvloop
from uvloop.loop import SSLProtocol as UvloopSSLProtocol  # type: ignore[attr-defined]

from shoal.frontend.http.head import HeadCheck
from shoal.frontend.http.request import BodyBudget
from shoal.frontend.http.server import Handler, HttpConnection

TURN_SECONDS = 0.005  # a sweep's slice: then the loop turns (as `proxy.deadlines`)


class Counted:
    """A TLS connection from its accept to its close: the loop's own TLS layer (the other
    base class: `Handshake`, `UvloopHandshake`) under its `HttpConnection`, which it makes.

    It is one of the server's `handshakes`, counted against `max_connections`, from its
    accept until its handshake is done (its connection is then one of `connections`:
    `HttpServer.admit`) or its socket closes; with no room it is closed at once, with no
    handshake (a 503 cannot be sent before one). Neither loop tells the connection above of
    a handshake that failed, timed out or was left: only this layer sees its socket close.
    """

    def __init__(self, server: HttpServer, tls: ssl.SSLContext, timeout: float | None) -> None:
        self.server = server
        self.conn = HttpConnection(server)
        self.socket: asyncio.BaseTransport | None = None
        cast(Any, super()).__init__(
            server.loop, self.conn, tls, None, server_side=True, ssl_handshake_timeout=timeout
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self.server
        if server.full or server.closing:
            transport.close()  # (no handshake: its `connection_lost` follows)
            return
        self.socket = transport
        server.handshakes[self.conn] = self
        cast(Any, super()).connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        conn = self.conn
        self.server.handshakes.pop(conn, None)
        if conn.transport is None:  # (never made: what it holds is let go as if it was lost)
            conn.connection_lost(None)
        del self.conn  # (its transport holds this layer: a cycle otherwise)
        self.socket = None
        cast(Any, super()).connection_lost(exc)


class Handshake(Counted, asyncio.sslproto.SSLProtocol):
    """`Counted` over the standard library's TLS layer."""


class UvloopHandshake(Counted, UvloopSSLProtocol):  # type: ignore[misc]
    """`Counted` over uvloop's (read by the loop itself, not through Python calls)."""


class HttpServer:
    """Listens on a TCP port and runs `handler` for each request.

    Limits: `max_body` bytes of request body; `max_header_size` bytes of request line and
    headers and `max_headers` headers (431); `header_timeout` seconds from a request's first
    byte (or a new connection's start) to the end of its head and `body_timeout` between
    body bytes (408; 0: no limit); `max_connections` clients at once (503 to the others;
    over TLS, counted from their accept: closed then, with no handshake); `max_body_memory`
    bytes of request bodies held by them all (`budget.py`: 503 to the request crossing it).
    """

    def __init__(
        self,
        handler: Handler,
        *,
        max_body: int,
        keepalive_timeout: float = 75.0,
        header_timeout: float = 10.0,
        body_timeout: float = 30.0,
        send_timeout: float = 60.0,
        max_header_size: int = 64 * 1024,
        max_headers: int = 100,
        max_connections: int = 10_000,
        max_body_memory: int = 1 << 30,
        head_check: HeadCheck | None = None,
    ) -> None:
        self.handler = handler
        self.head_check = head_check  # the handler's verdict on a head, before its body
        self.max_body = max_body
        self.keepalive_timeout = keepalive_timeout
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.send_timeout = send_timeout
        self.max_header_size = max_header_size
        self.max_headers = max_headers
        self.max_connections = max_connections
        self.bodies = BodyBudget(max_body_memory)  # (request bodies its connections hold)
        self.connections: set[HttpConnection] = set()  # served (over TLS: once shaken hands)
        self.handshakes: dict[HttpConnection, Counted] = {}  # TLS ones shaking hands
        self.closing = False
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Handle | None = None  # the next sweep, or the rest of this one

    async def start(
        self, host: str, port: int, tls: ssl.SSLContext | None = None, *, reuse_port: bool = False
    ) -> None:
        """Listen on `host:port`; over TLS (HTTPS) when given a server context; with
        `reuse_port`, beside the other processes listening there (`SO_REUSEPORT`). A TLS
        handshake has `header_timeout` (asyncio's own 60 s let sockets that never finish
        one outlive any head), and counts from the accept (`Counted`)."""
        factory: Callable[[], asyncio.BaseProtocol] = partial(HttpConnection, self)
        if tls is not None:
            layer = UvloopHandshake if isinstance(self.loop, uvloop.Loop) else Handshake
            factory = partial(layer, self, tls, self.header_timeout or None)
        self._server = await self.loop.create_server(
            factory, host, port, backlog=2048, reuse_address=True, reuse_port=reuse_port or None
        )
        self._sweeper = self.loop.call_later(self._sweep_every, self._sweep)

    @property
    def _sweep_every(self) -> float:
        timeouts = (
            self.keepalive_timeout, self.header_timeout, self.body_timeout, self.send_timeout
        )  # fmt: skip
        return max(min(t for t in timeouts if t > 0) / 4, 0.05)

    def _sweep(self) -> None:
        """Enforce the idle, head, body and send timeouts (one timer, not one per request)."""
        self._check(list(self.connections), self.loop.time(), 0)

    def _check(self, conns: list[HttpConnection], now: float, start: int) -> None:
        """Check `conns[start:]` (those open at the sweep of `now`); past `TURN_SECONDS`,
        the rest in the loop's next turn."""
        connections = self.connections
        began = time.perf_counter()
        for i in range(start, len(conns)):
            conn = conns[i]
            if conn in connections:  # (not closed since)
                conn.check_deadlines(now)
            if i & 31 == 31 and time.perf_counter() - began > TURN_SECONDS:
                self._sweeper = self.loop.call_soon(self._check, conns, now, i + 1)
                return
        self._sweeper = self.loop.call_later(self._sweep_every, self._sweep)

    def admit(self, conn: HttpConnection) -> bool:
        """Make `conn` one of `connections` if there is room (one whose TLS handshake is done
        had its place from its accept: `handshakes`)."""
        if self.handshakes.pop(conn, None) is None and self.full:
            return False
        self.connections.add(conn)
        return True

    @property
    def open_connections(self) -> int:
        """The connections counted against `max_connections`: served, or shaking hands."""
        return len(self.connections) + len(self.handshakes)

    @property
    def full(self) -> bool:
        return self.open_connections >= self.max_connections

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def busy(self) -> int:
        """Connections with a request being answered."""
        return sum(1 for conn in self.connections if not conn.idle)

    async def close(self, timeout: float) -> None:
        """Stop accepting, let requests in flight finish within `timeout`, then close everything."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for handshake in list(self.handshakes.values()):  # (no request yet: as if idle)
            if handshake.socket is not None:
                handshake.socket.close()
        deadline = self.loop.time() + timeout
        while True:
            for conn in list(self.connections):
                if conn.idle and conn.transport is not None:
                    conn.transport.close()
            if not self.connections or self.loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
