"""The gateway's HTTP/1.1 server: one `asyncio.Protocol` per connection, parsed by httptools.

A web framework costs more CPU per request than the whole proxy path should, so the server
is the minimum that is correct: keep-alive, pipelining (requests on one connection are
answered in order, one at a time), Content-Length and chunked request bodies, `Expect:
100-continue`, a body size limit, an idle timeout, and write-side flow control that the
proxy passes on to the upstream connection (`HttpConnection.flow`).

Each complete request is handed to the server's handler as a `Request` with its whole body,
straight from the parser's callback: no task per request. The handler answers through the
`HttpConnection`: `send()` for a whole response, or `write()`s and then `end()` for one that
is produced later (the proxy's), registering itself as `current` so that a client that goes
away cancels it. It clears `keep_alive` when the connection cannot carry another request.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import httptools

from shoal.frontend.errors import ApiError, bad_request, body_too_large, error_body

log = logging.getLogger(__name__)

MAX_PIPELINED = 16  # parsed requests waiting behind the current one before reading pauses
LINGER_SECONDS = 2.0  # how long the rest of a refused body is read before closing anyway


class Request:
    """One parsed request. Header names are lower-cased bytes; the body is complete."""

    __slots__ = (
        "body",
        "headers",
        "http11",
        "keep_alive",
        "method",
        "path",
        "query",
        "received",
        "too_large",
    )

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        keep_alive: bool,
        http11: bool,
    ) -> None:
        path, _, query = target.partition(b"?")
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http11 = http11
        self.too_large = False  # the body was over the limit and dropped: answered with 413
        self.received = time.perf_counter()

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


class FlowListener(Protocol):
    """What is told to stop producing while the client's send buffer is full."""

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class InFlight(Protocol):
    """A response being produced after the handler returned; told if the client goes away."""

    def cancel(self) -> None: ...


# A handler answers with `send()` (a whole response), or with `write()`s then `end()` later,
# setting `HttpConnection.current` meanwhile. It is called in the parser's callback: no task.
Handler = Callable[[Request, "HttpConnection"], None]

_status_lines: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    """`HTTP/1.1 200 OK\\r\\n`, cached per status."""
    line = _status_lines.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        line = _status_lines[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode()
    return line


def encode_response(
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    headers: Sequence[tuple[bytes, bytes]] = (),
    *,
    keep_alive: bool = True,
) -> bytes:
    parts = [
        status_line(status),
        b"content-type: ",
        content_type,
        b"\r\ncontent-length: ",
        str(len(body)).encode(),
        b"\r\n",
    ]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts += (b"\r\n", body)
    return b"".join(parts)


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests and answers them in order, one at a time."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.pending: deque[Request] = deque()
        self.busy = False  # a request is being answered
        self.current: InFlight | None = None  # what to cancel if the client goes away
        self.keep_alive = True  # cleared when this connection must close after the response
        self.response_started = False
        self.writing_paused = False
        self.flow: FlowListener | None = None  # told to pause while our send buffer is full
        self.closed = False
        self.idle_since = server.loop.time()
        self._reading_paused = False
        # The message being parsed.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_size = 0
        self._too_large = False
        self._refused_early = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.pending.clear()
        current, self.current = self.current, None
        if current is not None:
            current.cancel()  # the client went away: stop the work done for it

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(bad_request("Protocol upgrades are not supported."))
        except httptools.HttpParserError as exc:
            self._fail(bad_request(f"Malformed HTTP request: {exc}"))

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.flow is not None:
            self.flow.pause_reading()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.flow is not None:
            self.flow.resume_reading()

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._body_size = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        expect_continue = False
        for name, value in self._headers:
            if name == b"content-length":
                if int(value) > self.server.max_body:
                    self._too_large = True
            elif name == b"expect" and value.lower() == b"100-continue":
                expect_continue = True
        if self._too_large and not self.busy and not self.pending and self.transport is not None:
            # Answer at once, so the client stops sending; read and drop the rest of the body
            # (closing with unread data would reset the connection before the client reads).
            self._refused_early = True
            self.keep_alive = False
            error = body_too_large(self.server.max_body)
            self.transport.write(encode_response(error.status, error.body(), keep_alive=False))
            self.server.loop.call_later(LINGER_SECONDS, self.transport.close)
        elif expect_continue and not self._too_large and self.idle and self.transport is not None:
            # (Behind a request being answered, an interim 100 would land inside its response:
            # the client then sends the body after its own short wait.)
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return
        self._body_size += len(body)
        if self._body_size > self.server.max_body:
            self._too_large = True
            self._body = []
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        if self._refused_early:
            self.transport.close()
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            self.parser.get_method(),
            self._url,
            self._headers,
            b"" if self._too_large else body,
            keep_alive=bool(self.parser.should_keep_alive()) and not self._too_large,
            http11=self.parser.get_http_version() == "1.1",
        )
        request.too_large = self._too_large
        if not self.busy:
            self._dispatch(request)
            return
        self.pending.append(request)  # pipelined: answered when the one before it is
        if len(self.pending) >= MAX_PIPELINED and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    # -- answering requests in order ---------------------------------------------------------

    def _dispatch(self, request: Request) -> None:
        self.busy = True
        self.keep_alive = request.keep_alive and not self.server.closing
        self.response_started = False
        if request.too_large:
            self.keep_alive = False
            self.send_error(body_too_large(self.server.max_body))
            return
        try:
            self.server.handler(request, self)
        except Exception:
            log.exception("request %s %s failed", request.method.decode(), request.path.decode())
            self.keep_alive = False
            self.current = None
            if self.response_started:
                self.end()
            else:
                self.send(500, error_body("Internal error in the gateway.", type="server_error"))

    def end(self) -> None:
        """The response to the current request is complete: go on with the next one."""
        self.busy = False
        self.current = None
        self.flow = None
        if self.closed or self.transport is None:
            return
        if not self.keep_alive or self.server.closing:
            self.transport.close()
        elif self.pending:
            # Pipelined requests wait for the next loop iteration: never re-enter a handler
            # from the callback that finished the previous response.
            self.server.loop.call_soon(self._next)
        else:
            self.idle_since = self.server.loop.time()

    def _next(self) -> None:
        if self.closed or self.busy or not self.pending:
            return
        request = self.pending.popleft()
        if self._reading_paused and len(self.pending) < MAX_PIPELINED // 2:
            self._reading_paused = False
            if self.transport is not None:
                self.transport.resume_reading()
        self._dispatch(request)

    def _fail(self, error: ApiError) -> None:
        """Answer a request we could not parse or will not read, then close."""
        if self.transport is None or self.transport.is_closing():
            return
        self.keep_alive = False
        self.pending.clear()
        if not self.busy:
            self.send_error(error)
        self.transport.close()

    def send(
        self,
        status: int,
        body: bytes,
        content_type: bytes = b"application/json",
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        """Write a whole response; it ends the request."""
        if self.transport is not None and not self.transport.is_closing():
            self.response_started = True
            self.transport.write(
                encode_response(status, body, content_type, headers, keep_alive=self.keep_alive)
            )
        self.end()

    def send_error(self, error: ApiError) -> None:
        self.send(error.status, error.body())

    def write(self, data: bytes) -> None:
        """Write part of a streamed response (the proxy frames it); `end()` when done."""
        if self.transport is not None:
            self.response_started = True
            self.transport.write(data)

    @property
    def writable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    @property
    def idle(self) -> bool:
        return not self.busy and not self.pending


class HttpServer:
    """Listens on a TCP port and runs `handler` for each request."""

    def __init__(self, handler: Handler, *, max_body: int, keepalive_timeout: float = 75.0) -> None:
        self.handler = handler
        self.max_body = max_body
        self.keepalive_timeout = keepalive_timeout
        self.connections: set[HttpConnection] = set()
        self.closing = False
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        """Listen on `host:port`; over TLS (HTTPS) when given a server context."""
        self._server = await self.loop.create_server(
            lambda: HttpConnection(self), host, port, backlog=2048, reuse_address=True, ssl=tls
        )
        self._sweeper = self.loop.call_later(self._sweep_every, self._sweep)

    @property
    def _sweep_every(self) -> float:
        return max(self.keepalive_timeout / 4, 0.05)

    def _sweep(self) -> None:
        """Close connections idle for longer than the keep-alive timeout (one timer, not one per request)."""
        deadline = self.loop.time() - self.keepalive_timeout
        for conn in list(self.connections):
            if conn.idle and conn.idle_since < deadline and conn.transport is not None:
                conn.transport.close()
        self._sweeper = self.loop.call_later(self._sweep_every, self._sweep)

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
