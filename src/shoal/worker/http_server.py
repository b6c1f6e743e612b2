"""The worker's aiohttp servers (request ports, status server) with bounded connections.

aiohttp's own defaults keep a connection that sends nothing for an hour (keep-alive
3,630 s) and take any number of them: 1,100 silent connections used up a 1,024-fd worker,
whose chats then failed. Here a server holds:

- `max_connections` connections at most: a connection beyond it is answered
  `503 too_many_connections` (OpenAI format, `Connection: close`) and closed at once;
- a request's head: it must arrive within `HEAD_TIMEOUT` seconds of the connection's start,
  or of its first byte after a keep-alive wait, else the connection is closed silently;
- a request's body, from its handler's start while it is unfinished: no gap between its
  bytes longer than `BODY_TIMEOUT` seconds, and the whole of it within `BODY_TIMEOUT` plus
  a second per `BODY_MIN_RATE` bytes received (time while the server does not read is not
  counted), else the request is answered `408 request_timeout` (OpenAI format) if nothing
  was answered yet, and the connection is closed (after `LATE_BODY_LINGER` seconds more of
  reading and dropping what comes, so that a reset does not discard the answer). A gap alone (reset by each byte) let a
  body sent a byte every few seconds hold a place for ever: 64 of them kept every new
  connection to a request port answered 503;
- an idle keep-alive connection: closed after `KEEPALIVE_TIMEOUT` seconds;
- an answer its client does not read: once bytes wait in the connection's write buffer
  (writing paused, or an answer's end left there), the client must take some of them within
  `send_timeout` seconds, again and again until none wait, else the connection is dropped
  (aborted: a close waits for those bytes to go, for good) and its handler stopped. Nothing
  timed this side: 128 clients asking for a large metadata file and reading none of it held
  every place of a status server for good (`/live` answered 503 `too_many_connections`).

`start_server(app, host, port, ...)` serves `app` so; `runner.addresses` names the port.
"""

from __future__ import annotations

import asyncio
import fcntl
import resource
import struct
import termios
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from shoal.openai import ApiError

KEEPALIVE_TIMEOUT = 75.0
"""Seconds an idle keep-alive connection is kept (as the frontend's, nginx's)."""
HEAD_TIMEOUT = 15.0
"""Seconds a request's head may take from the connection's start (or its first byte)."""
BODY_TIMEOUT = 15.0
"""Seconds an unfinished request body may go without a byte, and its start's allowance."""
BODY_MIN_RATE = 64 * 1024
"""Bytes a second a body comes at on average past `BODY_TIMEOUT` (512 kbit/s): 16 MiB in
4.5 min at most, and a place held for T seconds costs T x 64 KiB sent."""
LATE_BODY_LINGER = 2.0
"""Seconds a connection answered 408 for a late body still reads (and drops) what comes."""
STATUS_MAX_CONNECTIONS = 128
"""Connections the status server holds at once: probes, scrapes and metadata fetches."""
SEND_TIMEOUT = 90.0
"""Seconds a request port's client may take none of the answer waiting for it. A frontend
passes its own slow client's pace on to the worker, and ends that client at its
`--send-timeout` (60 s by default), which must act first: a worker that cut the stream first
would look dead to the frontend (which would continue the stream elsewhere)."""
STATUS_SEND_TIMEOUT = 15.0
"""The same for the status server, whose readers (probes, scrapes, frontends fetching
metadata) read at once: a place held by one that does not is freed as soon as a silent one's."""


def request_port_max_connections() -> int:
    """Connections a request port holds at once: half the process's file-descriptor limit
    (a sidecar opens one upstream connection per request too), at least 64, at most 10,000."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(64, min(10_000, soft // 2))


def _closing_answer(status_line: str, error: ApiError) -> bytes:
    """`error` as a whole HTTP/1.1 answer that ends its connection."""
    body = error.body()
    head = (
        f"HTTP/1.1 {status_line}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _refusal(limit: int) -> bytes:
    error = ApiError(
        503,
        f"The server already holds its limit of {limit} connections on this port; retry shortly.",
        type="service_unavailable_error",
        code="too_many_connections",
    )
    return _closing_answer("503 Service Unavailable", error)


def _body_late(seconds: float, min_rate: float) -> bytes:
    error = ApiError(
        408,
        f"The request body did not keep coming: it may pause at most {seconds:g}s between "
        f"bytes, and must come at {min_rate:g} bytes/s on average past its first {seconds:g}s.",
        code="request_timeout",
    )
    return _closing_answer("408 Request Timeout", error)


class _Refuse(asyncio.Protocol):
    """A connection over the limit: the 503 written, then closed."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.WriteTransport, transport)  # (uvloop's is no asyncio subclass)
        writer.write(self._answer)
        writer.close()


class _TimedHandler(RequestHandler):
    """aiohttp's handler, closing a connection whose request head or body does not come in
    time (a body's time: from its handler's start, see the module's docstring)."""

    __slots__ = (
        "_body_answered",
        "_body_late",
        "_body_min_rate",
        "_body_progress",
        "_body_received",
        "_body_request",
        "_body_since",
        "_body_timeout",
        "_body_timer",
        "_drained",
        "_head_timeout",
        "_head_timer",
        "_heads_at_arm",
        "_late_close",
        "_send_timeout",
        "_send_timer",
        "_unsent",
    )

    def __init__(
        self,
        manager: web.Server,
        *,
        head_timeout: float,
        body_timeout: float,
        body_min_rate: float,
        body_late: bytes,
        send_timeout: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._send_timeout = send_timeout
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes waiting in the write buffer at the last look
        self._drained = False  # writing resumed since the last look: the client took bytes
        self._head_timeout = head_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._heads_at_arm = 0
        self._body_timeout = body_timeout
        self._body_min_rate = body_min_rate
        self._body_late = body_late  # the 408 answer
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_request: BaseRequest | None = None  # whose body is timed, while unfinished
        self._body_answered = False  # its handler has returned (its answer is written)
        self._body_since = 0.0  # when its time began (moved on by time the server did not read)
        self._body_received = 0  # bytes received since
        self._body_progress = 0.0  # when a byte last came (or the server was found not reading)
        self._late_close: asyncio.TimerHandle | None = None  # the end of a 408's linger

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

    async def _handle_request(
        self,
        request: BaseRequest,
        start_time: float | None,
        request_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        if self._body_timeout > 0 and not request.content.is_eof():
            if self._body_timer is not None:
                self._body_timer.cancel()
            self._body_request = request
            self._body_answered = False
            self._body_since = self._body_progress = self._loop.time()
            self._body_received = 0
            self._body_timer = self._loop.call_later(self._body_timeout, self._body_due)
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            if self._body_request is request:
                self._body_answered = True
            self._time_unsent()  # (an answer's end may wait in the buffer, writing unpaused)

    # -- the answer side: a client that reads nothing of it ------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        self._time_unsent()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._drained = True

    def _time_unsent(self) -> None:
        """Start timing the bytes waiting for the client, if some wait and none are timed."""
        transport = self.transport
        if self._send_timer is not None or self._send_timeout <= 0 or transport is None:
            return
        unsent = transport.get_write_buffer_size()
        if unsent:
            self._unsent, self._drained = unsent + _kernel_unsent(transport), False
            self._send_timer = self._loop.call_later(self._send_timeout, self._send_due)

    def _send_due(self) -> None:
        """A send timeout after the last look: writing resumed meanwhile or fewer bytes wait
        (the client read some: a new wait), more wait while writing is not paused (a new
        answer: a new wait), none wait (done), or the client took nothing: the connection is
        dropped. Bytes waiting count the socket's too (`_kernel_unsent`). (A stream read
        steadily, slower than it comes, goes between paused and resumed: paused at a look
        with more waiting than at the last, it was cut; and so while the socket's own
        buffer, full, drained to half before taking any of the write buffer.)"""
        self._send_timer = None
        transport = self.transport
        if transport is None:
            return
        unsent = transport.get_write_buffer_size()
        if not unsent:
            return
        unsent += _kernel_unsent(transport)  # (moves while the buffer here waits for room)
        if (
            self._drained
            or unsent < self._unsent
            or (unsent > self._unsent and not self.writing_paused)
        ):
            self._unsent, self._drained = unsent, False
            self._send_timer = self._loop.call_later(self._send_timeout, self._send_due)
            return
        handler = self._task_handler
        self.force_close()  # (no more requests: what it would answer is not read either)
        transport.abort()  # (a close would wait for the unread bytes to go: for ever)
        if handler is not None:
            handler.cancel()

    def _body_due(self) -> None:
        self._body_timer = None
        request = self._body_request
        transport = self.transport
        if request is None or request.content.is_eof() or self._force_close or transport is None:
            self._body_request = None
            return
        now = self._loop.time()
        allowance = self._body_received / self._body_min_rate
        if self._reading_paused:  # the server is not reading: the time is not the client's
            self._body_since = now - allowance
            self._body_progress = now
        due = self._body_timeout + min(self._body_progress, self._body_since + allowance)
        if now < due:
            self._body_timer = self._loop.call_at(due, self._body_due)
            return
        self._body_request = None
        handler = self._task_handler
        if self._body_answered or request.writer.output_size:
            self.force_close()  # an answer has begun: it is cut
            if handler is not None:
                handler.cancel()
            return
        # The 408, then what still comes is read and dropped for a while before the close: a
        # close with unread bytes resets the connection, and a reset can discard the answer.
        self._force_close = True  # (aiohttp drops what comes, and its loop ends)
        transport.write(self._body_late)
        if transport.can_write_eof():
            transport.write_eof()
        self._late_close = self._loop.call_later(LATE_BODY_LINGER, self._late_body_closed)

    def _late_body_closed(self) -> None:
        """The linger after a 408 is over: the connection is closed, its handler stopped."""
        self._late_close = None
        handler = self._task_handler
        self.force_close()
        if handler is not None:  # it waits for a body that will not come
            handler.cancel()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()  # a new connection: its first head, from its start

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._body_request is not None:
            self._body_progress = self._loop.time()
            self._body_received += len(data)
        # The first bytes of a head after a keep-alive wait (no timer, or one armed for a
        # head that came since): it has the head timeout from now.
        if (
            self._waiting_for_head()
            and not self._force_close
            and (self._head_timer is None or self._heads_at_arm != self._request_count)
        ):
            self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._late_close, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._send_timer = None
        if self._late_close is not None and self._task_handler is not None:
            self._task_handler.cancel()  # (before aiohttp fails its read: no error logged)
        self._head_timer = self._body_timer = self._late_close = None
        self._body_request = None
        super().connection_lost(exc)


def _kernel_unsent(transport: asyncio.BaseTransport) -> int:
    """Bytes the connection's socket has not yet seen taken (Linux's `TIOCOUTQ`; 0 where it
    cannot be read). The write buffer alone stands still while the kernel's send buffer,
    full, drains to half before taking more: a client reading steadily at 1.6 MB/s left it
    unmoved for longer than a 0.1 s send timeout (at 50 KB/s, a few MB: a minute)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", queued)[0])


class BoundedServer(web.Server):
    """`web.Server` holding at most `max_connections` connections, heads, bodies and unread
    answers timed (`body_timeout` 0: bodies untimed; `send_timeout` 0: answers untimed)."""

    def __init__(
        self,
        *args: Any,
        max_connections: int,
        head_timeout: float,
        body_timeout: float,
        body_min_rate: float,
        send_timeout: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if body_min_rate <= 0:
            raise ValueError(f"body_min_rate must be positive, got {body_min_rate}")
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.body_min_rate = body_min_rate
        self.send_timeout = send_timeout
        self.open = 0  # connections made and not yet lost
        self.refused = 0
        self._answer = _refusal(max_connections)
        self._body_late = _body_late(body_timeout, body_min_rate)

    def __call__(self) -> Any:  # a RequestHandler, or a refusal past the limit
        if self.open >= self.max_connections:
            self.refused += 1
            return _Refuse(self._answer)
        self.open += 1  # (counted here: accepts of one loop turn all see it)
        return _TimedHandler(
            self,
            loop=self._loop,
            head_timeout=self.head_timeout,
            body_timeout=self.body_timeout,
            body_min_rate=self.body_min_rate,
            body_late=self._body_late,
            send_timeout=self.send_timeout,
            **self._kwargs,
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
        body_timeout: float | None = None,
        body_min_rate: float | None = None,
        send_timeout: float | None = None,
        keepalive_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        keepalive = KEEPALIVE_TIMEOUT if keepalive_timeout is None else keepalive_timeout
        super().__init__(app, keepalive_timeout=keepalive, **kwargs)
        self._max_connections = max_connections
        self._head_timeout = HEAD_TIMEOUT if head_timeout is None else head_timeout
        self._body_timeout = BODY_TIMEOUT if body_timeout is None else body_timeout
        self._body_min_rate = BODY_MIN_RATE if body_min_rate is None else body_min_rate
        self._send_timeout = SEND_TIMEOUT if send_timeout is None else send_timeout

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return BoundedServer(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=asyncio.get_running_loop(),
            max_connections=self._max_connections,
            head_timeout=self._head_timeout,
            body_timeout=self._body_timeout,
            body_min_rate=self._body_min_rate,
            send_timeout=self._send_timeout,
            **made._kwargs,
        )


async def start_server(
    app: web.Application, host: str, port: int, *, max_connections: int, **kwargs: Any
) -> BoundedRunner:
    """Serve `app` on host:port (0: a free port) with the bounds above; `kwargs` go to the
    runner (`handler_cancellation`, `access_log`, `shutdown_timeout`, `head_timeout`,
    `body_timeout`, `body_min_rate`, `send_timeout`...)."""
    runner = BoundedRunner(app, max_connections=max_connections, **kwargs)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
