"""The gateway's HTTP/1.1 server, one `asyncio.Protocol` per connection (`HttpConnection`),
parsed by httptools; `listener.py` listens, `request.py` holds what a handler sees. A web
framework costs more CPU per request than the whole proxy path should: this is the minimum
that is correct (keep-alive, pipelining, length and chunked bodies, `Expect: 100-continue`,
limits, timeouts, write-side flow control passed upstream: `ClientConnection.follow`).
Each complete request goes to the handler as a `Request` with its whole body, from the
parser's callback; the handler answers with `send()`, or through `ClientConnection`.

What a connection owes its client, in order (RFC 9112 §9.3): an answer to every complete
request, one at a time, then (if reading stopped on an error) that error, then the close.
Pipelined requests are answered one per loop iteration, never while the client's send
buffer is full, and at most `MAX_PIPELINED` wait (plus those in one `FEED_SLICE` of bytes).
Bounds a client cannot stretch: the request head and trailers (size, count, `header_timeout`:
head.py), the body (`max_body` or its head's bound, `body_timeout` between its bytes,
`TURN_CALLS`), an answer it does not read (`send_timeout`: unread.py), the connections.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import cast

import httptools

from shoal.bounds import DepthMeter
from shoal.frontend.http import errors, head
from shoal.frontend.http.request import (
    BodyBudget,
    BodyPieces,
    FlowListener,
    InFlight,
    Request,
    encode_response,
)
from shoal.frontend.http.shared import Listener
from shoal.frontend.http.unread import Unread
from shoal.openai import ApiError

log = logging.getLogger(__name__)

MAX_PIPELINED = 16  # parsed requests waiting behind the current one before parsing stops
FEED_SLICE = 8192  # a larger read is parsed this much at a time, so the bound above holds
LINGER_SECONDS = 2.0  # how long bytes are read and dropped after the last answer, before closing
METER_FROM = 256 << 10  # a body this large has its nesting judged as it comes, so much at a time
TURN_BYTES = 256 << 10  # after reading this many bytes, a connection lets the loop turn
TURN_CALLS = 4096  # and after parsing this many body pieces (a body in 1-byte chunks)
LINGER_BYTES = 1 << 20  # and how many at least (twice `max_body` if more: see `_finish`)

IDLE, HEAD, BODY = 0, 1, 2  # what a connection reads: nothing yet of a request, a head, a body


# A handler answers with `send()`, or `produce_later()`, `write()`s and `finish()` later.
Handler = Callable[[Request, "HttpConnection"], None]


class StopParsing(Exception):
    """Raised in a parser callback once the connection reads no more requests."""


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests and answers them in order, one at a time.

    Invariant: once `_stopped`, no byte is parsed again; the connection answers what it owes
    (`busy`, `pending`, then `_final`) and closes. While it owes nothing it is never stopped
    without closing, and while it is not stopped every complete request gets an answer.
    """

    # Slots: 42 attributes, past the 30 keys CPython 3.11 shares among a class's instances.
    __slots__ = ("_answered_in_read", "_body", "_body_limit", "_body_size", "_calls", "_final",
        "_head_bytes", "_headers", "_held", "_held_pos", "_last_progress", "_linger_left",
        "_lingering", "_meter", "_next_scheduled", "_phase", "_phase_since", "_progress",
        "_read_bytes", "_reading_paused", "_refused", "_stopped", "_trailer_bytes",
        "_trailers", "_unread", "_upgrading", "_url", "busy", "closed", "current",
        "extra_headers", "flow", "head_only", "idle_since", "keep_alive", "loop", "parser",
        "pending", "response_started", "server", "transport", "writing_paused")  # fmt: skip
    __deletable__ = ("parser",)  # (a compiled build allows `del` of these only)

    def __init__(self, server: Listener[HttpConnection]) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.pending: deque[Request] = deque()
        self.busy = False  # a request is being answered
        self.current: InFlight | None = None  # what to cancel if the client goes away
        self.keep_alive = True  # cleared when this connection must close after the response
        self.head_only = False  # answering HEAD: the response carries no body
        self.extra_headers = b""  # header lines the handler adds to this response (CORS)
        self.response_started = self.writing_paused = self.closed = False
        self.flow: FlowListener | None = None  # told to pause while our send buffer is full
        self.idle_since = server.loop.time()  # 0.0: since the next sweep
        self._reading_paused = self._next_scheduled = False
        self._stopped = False  # no more requests are parsed (see the class invariant)
        self._final: ApiError | None = None  # answered after the requests owed, then close
        self._held, self._held_pos = b"", 0  # bytes read, not parsed yet: the pipeline is full
        self._answered_in_read = False  # one request answered per read: the others wait a turn
        self._upgrading = False  # the request asked for an Upgrade, which is ignored
        self._lingering = False  # the last answer is written: closing soon
        self._linger_left = 0  # bytes still dropped while lingering, then the connection closes
        self._phase = HEAD  # what is read since when (the sweep's deadlines): a request head
        self._phase_since = self.idle_since  # 0.0: since the next sweep
        self._progress = False  # bytes arrived since the last sweep
        self._last_progress = 0.0  # when a sweep last saw bytes arrive (0.0: never)
        self._unread = Unread()  # how long the client read nothing of its answer
        self._head_bytes = 0  # bytes read in a request head, or since a body's last byte
        self._trailers = self._trailer_bytes = 0  # the request's trailer fields (dropped)
        self._calls = 0  # body pieces parsed since the last turn given (`TURN_CALLS`)
        self._url = b""  # (the message being parsed)
        self._headers: list[tuple[bytes, bytes]] = []
        self._body = BodyPieces()
        self._body_size, self._body_limit = 0, server.max_body  # (its head's: `Verdict`)
        self._meter: DepthMeter | None = None  # a large body's nesting, judged as it arrives
        self._read_bytes = 0  # of large reads since the last turn given (`TURN_BYTES`)
        self._refused: ApiError | None = None  # the answer to the request read (`head.Verdict`)

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if not self.server.admit(self):  # (over TLS: counted from its accept, `Handshake`)
            self._stop(errors.too_many_connections(self.server.max_connections))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        # The parser holds this connection's methods: a reference cycle, left to the garbage
        # collector for every closed connection (a client without keep-alive: every request).
        del self.parser
        self._let_go()
        self._held = b""
        current, self.current = self.current, None
        if current is not None:
            current.cancel()  # the client went away: stop the work done for it

    def eof_received(self) -> bool | None:
        if self.current is not None:  # the client left (a FIN, as vLLM's server and nginx
            return None  # take it) while its answer is produced: close, which stops the work
        if self.busy or self.pending:
            self._stop(None)  # a half-closed client still gets the answers it asked for
            return True
        return None  # close

    def data_received(self, data: bytes) -> None:
        if self._stopped:  # after the last request: dropped (read to see the client leave)
            self._linger_left -= len(data)
            if self._linger_left < 0:
                if self._lingering and self.transport is not None:
                    self.transport.close()  # the client pushes on: enough was dropped
                else:
                    self._update_reading()  # (answers are owed: read no more)
            return
        self._progress = True
        self._answered_in_read = False
        calls = self._calls >= TURN_CALLS
        if self._held or len(data) > FEED_SLICE or len(self.pending) >= MAX_PIPELINED or calls:
            self._hold(data)
            # libuv reads a fast sender up to 32 times in one go (8 MB, each read parsed):
            # past `TURN_BYTES` of large reads, or `TURN_CALLS` parser callbacks (a body in
            # 1-byte chunks: 44,000 in 256 KiB), bytes are parsed in the loop's next turn.
            self._read_bytes += len(data)
            if self._read_bytes >= TURN_BYTES or calls:
                self._give_turn()
            else:
                self._parse_held()
            return
        offset = self._feed(data)
        if offset >= 0:  # an ignored upgrade: the fresh parser reads the rest
            self._hold(data[offset:])
            self._parse_held()

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.flow is not None:
            self.flow.pause_reading()
        self._update_reading()

    def resume_writing(self) -> None:
        self.writing_paused, self._unread.since = False, 0.0  # (the client read: a new wait)
        if self.flow is not None:
            self.flow.resume_reading()
        self._update_reading()
        if self.pending and not self.busy:
            self._schedule_next()

    # -- parsing -----------------------------------------------------------------------------

    def _feed(self, data: bytes | memoryview) -> int:
        """Parse `data` (as `data_received` does); -1, or the offset of the bytes after an
        ignored upgrade request."""
        self._head_bytes += len(data)  # (`on_body` sets it to 0)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._parse_failed(exc)
        except httptools.HttpParserUpgrade as exc:
            if self._upgraded():
                return int(exc.args[0])
        else:
            # (checked on each read: a head, or trailers, growing without end is not buffered)
            if self._phase != IDLE and (size := self.server.max_header_size) < self._head_bytes:
                if self._phase == HEAD:
                    self._stop(errors.headers_too_large(f"over {size} bytes"))
                else:
                    self._stop(head.framing_too_large(self.server))
        return -1

    def _upgraded(self) -> bool:
        """True if the parser stopped at an upgrade this server ignores (the bytes after it
        go to a fresh parser); False for CONNECT, which ends the connection."""
        if self._upgrading:
            self._restart_parser()
            return True
        self._stop(None)  # CONNECT: what follows is a tunnel, which this server is not
        return False

    def _parse_failed(self, exc: httptools.HttpParserError) -> None:
        if self._stopped:
            return  # a callback refused the request, or it was the last one
        if isinstance(exc, httptools.HttpParserCallbackError):  # a bug in a callback
            log.exception("parsing a request failed")
            self._stop(errors.internal_error())
        else:
            self._stop(errors.bad_request(f"Malformed HTTP request: {exc}"))

    def _hold(self, data: bytes | memoryview) -> None:
        rest = self._held[self._held_pos :]
        self._held = rest + data if rest else bytes(data)
        self._held_pos = 0

    def _give_turn(self) -> None:
        """Parse the held bytes in the loop's next turn (reading paused meanwhile)."""
        self._read_bytes = self._calls = 0
        self._update_reading()
        self.loop.call_soon(self._parse_held)

    def _parse_held(self) -> None:
        """Parse held bytes a slice at a time while the pipeline has room, the rest in the
        loop's next turn past `TURN_CALLS` parser callbacks."""
        data = self._held
        view = memoryview(data)
        pos = self._held_pos
        while pos < len(data) and not self._stopped and len(self.pending) < MAX_PIPELINED:
            if self._calls >= TURN_CALLS:
                break
            piece = view[pos : pos + FEED_SLICE]
            pos += len(piece)
            offset = self._feed(piece)
            if offset >= 0:  # an ignored upgrade: the fresh parser reads the rest
                data = self._held + bytes(piece[offset:]) + data[pos:]
                view = memoryview(data)
                pos = 0
        self._held, self._held_pos = (b"", 0) if pos >= len(data) or self._stopped else (data, pos)
        if self._held and self._calls >= TURN_CALLS:
            self._give_turn()
        else:
            self._update_reading()

    def _restart_parser(self) -> None:
        """Ignore an `Upgrade` (RFC 9110 §7.8 allows it): a fresh parser reads the request
        again without it, body included, and the connection carries on as HTTP/1.1."""
        self._upgrading = False
        parser = self.parser  # (the upgrade request's method and version: it stopped there)
        method, version = parser.get_method(), parser.get_http_version()
        self.parser = httptools.HttpRequestParser(self)  # (it reads the head, then the rest)
        self._held = head.without_upgrade(method, self._url, self._headers, version)
        self._held_pos = 0
        self._phase = IDLE

    def _refuse(self, error: ApiError) -> None:  # (what is owed, then `error`, then close)
        self._stop(error)
        raise StopParsing

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body.reset()
        self._body_size = 0
        self._meter = None
        self._trailers = self._trailer_bytes = 0
        if self._phase == IDLE:
            self._phase = HEAD
            self._phase_since = 0.0  # set by the next sweep: no clock read per request

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._phase != BODY:
            self._headers.append((name.lower(), value))
            return
        self._trailers += 1  # a trailer field: never a header, dropped (head.py)
        self._trailer_bytes += len(name) + len(value)
        if error := head.refused_trailers(self._trailers, self._trailer_bytes, self.server):
            self._refuse(error)

    def on_headers_complete(self) -> None:
        self._phase = BODY
        self._head_bytes = 0
        judged = head.judge_head(self.parser, self._url, self._headers, self.server)
        if judged.error is not None:
            self._refuse(judged.error)
        self._body_limit = self.server.max_body if judged.max_body is None else judged.max_body
        self._refused = judged.refused  # (answered so once its body is read)
        self._upgrading = judged.upgrade
        if judged.expect_continue and not self._upgrading and self.idle and self.transport:
            # (not behind an answer: a 100 would land in it; the client sends after a wait)
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._head_bytes = 0  # (bytes of chunk framing since: bounded as a head is)
        self._calls += 1
        self._body_size += len(body)
        fits = self.server.bodies.take(len(body))  # (given back: `_dispatch`, `_let_go`)
        if self._body_size > self._body_limit:
            self._refuse(errors.body_too_large(self._body_limit))
        if not fits:
            self._refuse(errors.bodies_held(self.server.bodies.limit))
        self._body.add(body)  # (a refused request's too: at most `head.DRAINED_BODY`, dropped)
        if self._body_size >= METER_FROM:  # (judged `METER_FROM` bytes at a time)
            meter = self._meter = self._meter or DepthMeter()
            if self._body_size - meter.fed >= METER_FROM:
                meter.feed_new(self._body.pieces)

    def on_message_complete(self) -> None:
        self._phase = IDLE
        if self._upgrading:  # the body is parsed again once the upgrade is ignored
            self.server.bodies.give(self._body_size)
            return
        body = self._body.whole(METER_FROM)  # (a large one joined when read: off the loop)
        request = Request(
            self.parser.get_method(),
            self._url,
            self._headers,
            body,
            keep_alive=bool(self.parser.should_keep_alive()),
            http11=self.parser.get_http_version() == "1.1",
        )
        if self._meter is not None:
            request.too_deep = self._meter.feed_new(self._body.pieces)
        request.refused = self._refused
        if self.busy or self.pending or self.writing_paused or self._answered_in_read:
            self.pending.append(request)  # answered in its turn, on a later loop iteration
            if not self.busy:
                self._schedule_next()
            if len(self.pending) >= MAX_PIPELINED:
                self._update_reading()
        else:
            self._answered_in_read = True
            self._dispatch(request)
        if not request.keep_alive:
            self._stop(None)  # the last request of this connection: what follows is dropped
            raise StopParsing

    # -- answering requests in order ---------------------------------------------------------

    def _dispatch(self, request: Request) -> None:
        self.server.bodies.give(request.size)  # (the handler's from now on)
        self.busy = True
        self.keep_alive = request.keep_alive and not self.server.closing
        self.response_started = False
        self.head_only = request.method == b"HEAD"
        try:
            if request.refused is None:
                self.server.handler(request, self)
            else:  # (refused on its head, its small body dropped: the connection stays)
                self.send_error(request.refused)
        except Exception:
            log.exception("request %s %s failed", request.method.decode(), request.path.decode())
            self.keep_alive = False
            self.current = None
            if self.response_started:
                self.end()
            else:
                self.send_error(errors.internal_error())

    def end(self) -> None:
        """The response to the current request is complete: go on with the next one."""
        self.busy = False
        self.current = None
        self.flow = None
        self.extra_headers = b""
        if self.closed or self.transport is None:
            return
        if not self.keep_alive or self.server.closing:
            self._finish()
        elif self.pending:  # (next iteration: no handler entered from the previous callback)
            self._schedule_next()
        elif self._stopped:
            self._finish()
        else:
            self.idle_since = 0.0  # dated by the next sweep: no clock read per request

    def _schedule_next(self) -> None:
        if not self._next_scheduled:
            self._next_scheduled = True
            self.server.loop.call_soon(self._next)

    def _next(self) -> None:
        self._next_scheduled = False
        if self.closed or self.busy or not self.pending or self.writing_paused:
            return  # `end()` or `resume_writing()` schedules it again
        self._dispatch(self.pending.popleft())
        if self._held and len(self.pending) < MAX_PIPELINED // 2:
            self._answered_in_read = True
            self._parse_held()
        self._update_reading()
        if self.pending and not self.busy:
            self._schedule_next()

    def _update_reading(self) -> None:
        """Read the socket unless the client is not reading its answers, the pipeline is
        full, or answers are owed after reading stopped and the bytes dropped since passed
        `_linger_left` (before, the reads see the client leave: idempotent)."""
        owed = self.busy or bool(self.pending)
        paused = (
            self.writing_paused
            or len(self.pending) >= MAX_PIPELINED
            or bool(self._held)
            or (self._stopped and owed and self._linger_left < 0)
        )
        if paused == self._reading_paused:
            return
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._reading_paused = paused
        if paused:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def _stop(self, error: ApiError | None) -> None:
        """Parse nothing more; answer what is owed, then `error` if any, then close."""
        if self._stopped:
            return
        self._stopped, self._final, self._held = True, error, b""
        self._let_go(keep_pending=True)
        self._linger_left = max(LINGER_BYTES, 2 * self.server.max_body)  # (dropped, then paused)
        if self.busy or self.pending:
            self._update_reading()
        else:
            self._finish()

    def _let_go(self, keep_pending: bool = False) -> None:
        """Give back the `bodies` held: the one being read, and the waiting ones (dropped)."""
        reading, self._body_size = (self._body_size if self._phase == BODY else 0), 0
        if reading:
            self._body.reset()  # (never read now: its pieces go with its count)
        self.server.bodies.let_go(reading, None if keep_pending else self.pending)

    def _finish(self) -> None:
        """Write the final error if one is owed, then close as nginx does: shut down our side,
        read and drop what still arrives, close after `LINGER_SECONDS` or past the budget
        (`LINGER_BYTES` or twice `max_body`). A client that writes its whole body before
        reading (httpx, requests) gets its 413, not the reset of a close with unread bytes."""
        self._stopped = True
        transport = self.transport
        if self._lingering or transport is None or transport.is_closing():
            return
        self._lingering = True
        self._linger_left = max(LINGER_BYTES, 2 * self.server.max_body)
        self._let_go()  # (requests waiting when the response cut the connection short)
        error, self._final = self._final, None
        if error is not None:  # (its header lines too: a refused head's CORS lines)
            transport.write(encode_response(error.status, error.body(), headers=error.headers, keep_alive=False))  # fmt: skip
        self._update_reading()
        if transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:  # the client is already gone (ENOTCONN): nothing left to tell it
                transport.abort()
                return
        self.server.loop.call_later(LINGER_SECONDS, transport.close)

    def check_deadlines(self, now: float) -> None:
        """Close or answer 408 if the client took too long (the server's sweep, which dates
        what the request path only flags: two sweeps late at most, never early)."""
        if self._progress:
            self._progress = False
            self._last_progress = now
        server, transport = self.server, self.transport
        if transport is not None and self._unread.overdue(
            transport, self.writing_paused, now, server.send_timeout
        ):  # it reads nothing of its answer (a `close()` waits for it): gone, the work stops
            transport.abort()
            return
        if self._stopped or self.busy or self.pending or self.transport is None:
            return
        if self._phase == IDLE:
            if not self.idle_since:
                self.idle_since = now
            elif now - self.idle_since > server.keepalive_timeout:
                self.transport.close()
        elif self._reading_paused:
            return  # we are not reading: the time is not the client's
        elif self._phase == HEAD:
            if not self._phase_since:
                self._phase_since = now
            elif server.header_timeout and now - self._phase_since > server.header_timeout:
                if not self._last_progress:
                    self.transport.close()  # nothing was ever sent: nothing to answer
                else:
                    self._stop(errors.request_timeout("request head", server.header_timeout))
        elif server.body_timeout and now - self._last_progress > server.body_timeout:
            self._stop(errors.request_timeout("rest of the request body", server.body_timeout))

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
                encode_response(
                    status, body, content_type, headers, self.keep_alive, self.extra_headers, self.head_only
                )
            )  # fmt: skip
        self.end()

    def send_pieces(self, status: int, pieces: Sequence[bytes], content_type: bytes) -> None:
        """`send` of a body in pieces, written as they are (one `writelines`), never joined."""
        if self.transport is not None and not self.transport.is_closing():
            self.response_started = True
            head = encode_response(
                status, b"", content_type, (), self.keep_alive, self.extra_headers,
                length=sum(map(len, pieces)),
            )  # fmt: skip
            self.transport.writelines([head] if self.head_only else [head, *pieces])
        self.end()

    def send_error(self, error: ApiError) -> None:
        self.send(error.status, error.body(), headers=error.headers)

    # -- a response produced later (`ClientConnection`) --------------------------------------

    def produce_later(self, work: InFlight) -> None:
        """The response comes later from `work`, which is cancelled if the client goes away."""
        self.current = work

    def follow(self, flow: FlowListener | None) -> None:
        """`flow` produces the response from now on: it is paused while the client's send
        buffer is full, at once if it is full now (idempotent). None: nothing produces."""
        self.flow = flow
        if flow is not None and self.writing_paused:
            flow.pause_reading()

    def close_after_response(self) -> None:
        """Close the connection after this response: the only end a client can see of a body
        without a length, or of one cut short."""
        self.keep_alive = False

    def finish(self, error: ApiError | None = None) -> None:
        """The response is complete, or failed with `error`: answered as such if no byte
        of the response was sent yet."""
        if error is not None and not self.response_started:
            self.send_error(error)
        else:
            self.end()

    def write(self, data: bytes) -> None:
        """Write part of a streamed response (the proxy frames it); `finish()` when done. The
        first write starts with the status line: `extra_headers` go right after it."""
        if self.transport is not None:
            if not self.response_started:
                self.response_started = True
                if self.extra_headers:
                    line_end = data.index(b"\r\n") + 2
                    data = data[:line_end] + self.extra_headers + data[line_end:]
            self.transport.write(data)

    def write_if_open(self, data: bytes) -> bool:
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        if self.response_started:
            transport.write(data)
        else:
            self.write(data)
        return True

    @property
    def writable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    @property
    def bodies(self) -> BodyBudget:
        return self.server.bodies

    @property
    def idle(self) -> bool:
        return not self.busy and not self.pending
