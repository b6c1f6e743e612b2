"""Connections to workers: one `Upstream` per endpoint instance, holding keep-alive connections.

An `UpstreamConnection` carries one exchange at a time: the proxy writes a request with
`send()` and the connection hands the response to a `ResponseSink` as httptools parses it:
the head, then each packet's pieces of body as they arrive (chunked framing removed), in one
call per packet, then the end. A sink that cannot keep up pauses the connection's reading.
At most `TURN_CALLS` body pieces are parsed a turn of the loop (1-byte chunks held it for
seconds): a read over `FEED_SLICE` a slice at a time, the rest after a turn, reading paused.

A connection goes back to its `Upstream`'s idle list when a response ends and both sides
allow keep-alive; it is closed on any error, and leaves the idle list when the worker closes it.

Workers are reached over plain HTTP; an external provider (a virtual model's `url` target)
also over HTTPS, when the `Upstream` is given an `ssl.SSLContext` (SNI and certificate
verification as the context says).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ssl
import time
from types import SimpleNamespace
from typing import ClassVar, cast

import httptools

from shoal.frontend.http.exchange import (
    ConnectRefused,
    FramingTooLarge,
    OutOfFiles,
    ResponseSink,
    UpstreamError,
    UpstreamTimeout,
)
from shoal.frontend.http.opening import open_within
from shoal.frontend.http.target import parse_target

MAX_IDLE = 256  # idle keep-alive connections kept per instance
MAX_RESPONSE_HEAD = 64 * 1024  # bytes of header lines in a response, its interim ones included
# (and bytes of chunk framing, extensions and trailer section read between two body bytes)
FEED_SLICE = 8192  # a larger read is parsed this much at a time, so the bound below holds
TURN_CALLS = 2048  # body pieces parsed per turn of the loop at most (and one slice's more)
_OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE})  # (the gateway's own limit)


class Upstream:
    """One endpoint instance as the request path sees it: its address, pool and load.

    Or, with `provider`, an external OpenAI-compatible server a virtual model routes to:
    `url` is its base URL; of the client's headers it gets only `proxy.PROVIDER_HEADERS`,
    never the client's own `Authorization` (only `authorization`, the bearer token of its
    secret, when it has one).

    `in_flight` counts requests this frontend has open on it (for least-loaded routing);
    `inhibited_until` (monotonic seconds) keeps it out of routing after a failure.
    `inhibitions_end` is the latest `inhibited_until` of any instance in the process, so
    routing knows in one comparison that nothing is inhibited (the common case).
    """

    inhibitions_end: ClassVar[float] = 0.0

    # A frontend holds one per instance of its fleet: slots, not a dict per instance.
    __slots__ = (
        "address",
        "authorization",
        "closed",
        "connect_timeout",
        "host",
        "host_header",
        "idle",
        "in_flight",
        "inhibited_until",
        "instance_id",
        "label",
        "path_prefix",
        "path_skip",
        "port",
        "provider",
        "tls",
        "url",
    )

    instance_id: int
    url: str
    address: str
    host: str
    tls: ssl.SSLContext | None
    port: int
    authorization: bytes | None
    provider: bool
    path_prefix: bytes
    path_skip: int
    host_header: bytes
    label: bytes

    def __init__(
        self,
        instance_id: int,
        url: str,
        *,
        connect_timeout: float = 5.0,
        tls: ssl.SSLContext | None = None,
        provider: bool = False,
    ) -> None:
        (
            self.instance_id, self.url, self.address, self.host, self.tls, self.port,
            self.authorization, self.provider, self.path_prefix, self.path_skip,
            self.host_header, self.label,
        ) = parse_target(instance_id, url, tls, provider)  # fmt: skip
        self.connect_timeout = connect_timeout
        self.idle: list[UpstreamConnection] = []
        self.in_flight = 0
        self.inhibited_until = 0.0
        self.closed = False

    def __repr__(self) -> str:
        return f"<Upstream {self.instance_id:x} {self.address}>"

    @property
    def inhibited(self) -> bool:
        """True while a recent failure keeps this instance out of routing."""
        if self.inhibited_until == 0.0:
            return False
        if self.inhibited_until > time.monotonic():
            return True
        self.inhibited_until = 0.0
        return False

    def inhibit(self, seconds: float) -> None:
        self.inhibited_until = until = time.monotonic() + seconds
        if until > Upstream.inhibitions_end:
            Upstream.inhibitions_end = until

    @staticmethod
    def any_inhibited() -> bool:
        """False when no instance at all is inhibited: routing can skip inhibition checks."""
        end = Upstream.inhibitions_end
        if end == 0.0:
            return False
        if end > time.monotonic():
            return True
        Upstream.inhibitions_end = 0.0
        return False

    def take_idle(self) -> UpstreamConnection | None:
        """The most recently used idle connection that is still open, if any."""
        idle = self.idle
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
        return None

    async def connect(self) -> UpstreamConnection:
        """Open a new connection; raises `UpstreamError` if it cannot within the timeout."""
        loop = asyncio.get_running_loop()
        made: list[UpstreamConnection] = []
        # (a partial, not a closure: a compiled build's closure and the frame it closes over
        # hold each other, a reference cycle per connect)
        protocol = functools.partial(_made, self, made)
        try:
            try:  # (the timeout is entered in `opening`: see there)
                conn = await open_within(
                    loop, protocol, self.host, self.port, self.tls, self.connect_timeout
                )
            except BaseException:
                # uvloop makes the connection before it connects, and tells it nothing (no
                # `connection_lost`) when the connect fails or is cancelled: its reference
                # cycles (its parser, its transport) would wait for the garbage collector.
                for each in made:
                    each.given_up()
                raise
        except TimeoutError as exc:
            raise UpstreamTimeout(f"cannot connect to {self.address}: timed out") from exc
        except OSError as exc:
            if exc.errno in _OUT_OF_FILES:
                raise OutOfFiles(f"cannot open a connection to {self.address}: {exc}") from exc
            raise ConnectRefused(f"cannot connect to {self.address}: {exc}") from exc
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        """Keep `conn` for the next request, or close it if this instance is gone or full."""
        if self.closed or len(self.idle) >= MAX_IDLE or not conn.usable:
            conn.close()
        else:
            self.idle.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        """The instance left: close idle connections; busy ones close when their response ends."""
        self.closed = True
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()


def _made(upstream: Upstream, made: list[UpstreamConnection]) -> UpstreamConnection:
    """A connection to `upstream` for `Upstream.connect`, kept in `made` too."""
    made.append(UpstreamConnection(upstream))
    return made[-1]


class UpstreamConnection(asyncio.Protocol):
    """One HTTP/1.1 connection to an instance, carrying one exchange at a time."""

    __deletable__ = ("parser",)  # (a compiled build allows `del` of these only)

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        # The pieces of body of the packet being parsed: the parser appends them itself (a
        # list's `append` as its `on_body`, no Python frame per piece), the sink gets them
        # once the packet is parsed (`on_packet`), or before the end (`on_message_complete`).
        self._bodies: list[bytes] = []
        self.parser = httptools.HttpResponseParser(
            SimpleNamespace(  # (what the parser calls: it reads these names once, when made)
                on_header=self.on_header,
                on_headers_complete=self.on_headers_complete,
                on_body=self._bodies.append,
                on_message_begin=self.on_message_begin,
                on_message_complete=self.on_message_complete,
            )
        )
        self.transport: asyncio.Transport | None = None
        self.sink: ResponseSink | None = None
        self.reused = False  # carried a response before this one
        self.answered = False  # a byte of the current exchange's response head arrived
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunked = False  # the head being read says `Transfer-Encoding: chunked`
        self._has_length = False  # it has a `Content-Length`
        self._until_eof = False  # the response has no length: it ends when the connection does
        self._interim = False  # parsing a 1xx response
        self._head_bytes = 0  # of the response being read, interim responses included
        self._head_read = 0  # bytes read while its final head is incomplete (the same bound)
        self._framing = 0  # bytes read since its last body byte, once chunked (the same bound)
        self._in_head = False  # its final head is not complete yet
        self._paused = False  # by the client's flow (`pause_reading`)
        self._calls = 0  # body pieces parsed by `_parse_held` in this turn (`TURN_CALLS`)
        # A read of at most this many bytes is parsed whole (a loop reads again in one turn
        # only after a full buffer); a held read sets it to -1, a turn that parsed held bytes
        # to what is left of the turn, 4 bytes a piece (a 1-byte chunk is 6). Else `_held_read`.
        self._room = FEED_SLICE
        self._held = b""  # read, not parsed yet: waiting for the loop's next turn
        self._held_pos = 0
        self._waiting = False  # reading paused until the loop's next turn parses `_held`

    @property
    def paused(self) -> bool:
        """Reading is paused because the client is not keeping up."""
        return self._paused

    @property
    def maybe_stale(self) -> bool:
        """Failed as one the instance had closed while it sat idle in the pool: pooled, and
        not a byte of the answer came. (Any byte says the instance had the request.)"""
        return self.reused and not self.answered

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and self.sink is None

    def send(self, data: bytes, body: bytes, sink: ResponseSink) -> None:
        """Write a request (head, then body) and deliver its response to `sink`."""
        assert self.transport is not None
        self.sink = sink
        self.answered = False
        self._headers = []
        self._chunked = self._has_length = False
        self._until_eof = False
        self._interim = False
        self._head_bytes = self._head_read = self._framing = 0
        self._in_head = True
        if len(body) < 65536:
            self.transport.write(data + body)
        else:
            self.transport.write(data)
            self.transport.write(body)

    def close(self) -> None:
        self.sink = None
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection now: the worker sees the client go and stops the request."""
        self.sink = None
        if self.transport is not None:
            self.transport.abort()

    def given_up(self) -> None:
        """Its connect failed or was cancelled (`Upstream.connect`): closed, and what refers
        back to it dropped now, as `connection_lost` would (which may never come)."""
        self.abort()
        self.transport = None
        self._drop_parser()

    def _drop_parser(self) -> None:
        """The parser holds this protocol's methods: a reference cycle, left to the garbage
        collector for every closed connection (and for good in a frozen registry)."""
        with contextlib.suppress(AttributeError):  # (dropped already: `given_up`)
            del self.parser

    # FlowListener: the client's send buffer is full, or has drained.

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None and not self.transport.is_closing():
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.transport.is_closing():
            self._paused = False
            if not self._waiting:
                self.transport.resume_reading()

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if self._held and self.sink is not None:  # (read before the end: parsed first)
            held, self._held = self._held[self._held_pos :], b""
            self._held_pos = 0
            if self._feed(held):
                self._deliver()
        self._held, self._held_pos = b"", 0
        self.upstream.forget(self)
        self._drop_parser()
        self.transport = None
        sink, self.sink = self.sink, None
        if sink is None:
            return
        if self._until_eof and exc is None:  # (a reset is no end: the answer was cut)
            sink.on_complete()
        else:
            reason = f": {exc}" if exc else ""
            sink.on_failure(UpstreamError(f"connection to {self.upstream.address} lost{reason}"))

    def data_received(self, data: bytes) -> None:
        if len(data) > self._room:  # (bytes held, a large read, or the pieces' room spent)
            self._held_read(data)
            return
        if self.sink is None:
            # Nothing was asked: a late byte of an abandoned response, or a protocol error.
            if self.transport is not None:
                self.transport.close()
            return
        in_head = self._in_head  # (as `_feed`, inline: a stream's every event comes here)
        if in_head:
            self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._failed(None if self._head_bytes > MAX_RESPONSE_HEAD else exc)
            return
        except httptools.HttpParserUpgrade:  # (a 101: failed in its head, `_interim_head`)
            self._failed(ValueError("it switched protocols"))
            return
        if in_head and self._in_head:  # (a header line without end grows in the parser)
            self._head_read += len(data)
            if self._head_read > MAX_RESPONSE_HEAD:
                self._failed(None)
                return
        elif not in_head and self._chunked:  # (`_framed`, its test inline: every event)
            if self._bodies:
                self._framing = 0
            elif self._framed(len(data)):
                return
        sink, bodies = self.sink, self._bodies  # (as `_deliver`, inline)
        if sink is None:  # (it ended in this packet; pieces after its end are of a response
            bodies.clear()  # nobody asked for, and the connection is closed: `on_message_begin`)
            return
        try:
            sink.on_packet(bodies)
        except Exception as exc:  # (as a parser's callback raising: the response fails)
            bodies.clear()
            self._failed(exc)
            return
        bodies.clear()

    def _deliver(self) -> None:
        """The pieces of body parsed go to the sink, in one call (`on_packet`)."""
        sink, bodies = self.sink, self._bodies
        if sink is None:  # (it ended in this packet; pieces after its end are of a response
            bodies.clear()  # nobody asked for, and the connection is closed: `on_message_begin`)
            return
        try:
            sink.on_packet(bodies)
        except Exception as exc:  # (as a parser's callback raising: the response fails)
            bodies.clear()
            self._failed(exc)
            return
        bodies.clear()

    def _feed(self, data: bytes | memoryview) -> bool:
        """Parse `data`; False if the response cannot be read (the sink was told)."""
        in_head = self._in_head
        if in_head:
            self.answered = True
        before = len(self._bodies)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._failed(None if self._head_bytes > MAX_RESPONSE_HEAD else exc)
            return False
        except httptools.HttpParserUpgrade:  # (a 101: failed in its head, `_interim_head`)
            self._failed(ValueError("it switched protocols"))
            return False
        if in_head and self._in_head:  # (a header line without end grows in the parser)
            self._head_read += len(data)
            if self._head_read > MAX_RESPONSE_HEAD:
                self._failed(None)
                return False
        elif not in_head and self._chunked:
            if len(self._bodies) > before:
                self._framing = 0
            elif self._framed(len(data)):
                return False
        return True

    def _framed(self, size: int) -> bool:
        """Count `size` bytes of chunk framing parsed with no body piece (a piece resets it);
        True past `MAX_RESPONSE_HEAD`: the response failed (endless trailers or extensions)."""
        if self.sink is None:
            return False
        self._framing += size
        if self._framing <= MAX_RESPONSE_HEAD:
            return False
        self._failed(
            FramingTooLarge(f"chunk framing over {MAX_RESPONSE_HEAD} bytes between body bytes")
        )
        return True

    def _held_read(self, data: bytes) -> None:
        """A read past `_room`: held, then parsed a slice at a time now, or in the loop's next
        turn when reads parsed whole spent this turn's room for pieces."""
        if self.sink is None and not self._held:
            if self.transport is not None:  # (as in `data_received`)
                self.transport.close()
            return
        spent = not self._held and self._room < FEED_SLICE
        self._hold(data)
        if self._waiting:
            return
        if spent:
            self._give_turn()
        else:
            self._parse_held()

    def _hold(self, data: bytes) -> None:
        rest = self._held[self._held_pos :]
        self._held = rest + data if rest else data
        self._held_pos = 0
        self._room = -1  # (every read is held behind these)

    def _give_turn(self) -> None:
        """Parse the held bytes in the loop's next turn, reading paused meanwhile."""
        if self._waiting:
            return
        self._waiting = True
        transport = self.transport
        if transport is not None and not transport.is_closing() and not self._paused:
            transport.pause_reading()
        asyncio.get_running_loop().call_soon(self._parse_held)

    def _parse_held(self) -> None:
        """Parse the held bytes a slice at a time, up to `TURN_CALLS` body pieces this turn;
        the rest in the loop's next turn."""
        resumed, self._waiting = self._waiting, False
        self._calls = 0
        data = self._held
        view = memoryview(data)
        while self._held_pos < len(data) and self._calls < TURN_CALLS:
            if self.transport is None or self.transport.is_closing():
                break  # failed, or closed by a callback: what is left is dropped
            piece = view[self._held_pos : self._held_pos + FEED_SLICE]
            self._held_pos += len(piece)
            before = len(self._bodies)
            if not self._feed(piece):
                break
            self._calls += max(0, len(self._bodies) - before)  # (an end delivers them)
        view.release()
        transport = self.transport
        if transport is None or transport.is_closing() or self._held_pos >= len(data):
            self._held, self._held_pos = b"", 0  # (all parsed, or what is left is dropped)
        self._deliver()  # (the turn's pieces in one call: one write to the client)
        if self._held:
            self._give_turn()
            return
        # (a read later in this turn gets what is left of it; the next turn's, all: `_room`)
        self._room = min(FEED_SLICE, max(0, TURN_CALLS - self._calls) << 2)
        asyncio.get_running_loop().call_soon(self._turn_over)
        if resumed and not self._paused and transport is not None and not transport.is_closing():
            transport.resume_reading()

    def _turn_over(self) -> None:
        if self._room >= 0:  # (-1: bytes are held)
            self._room = FEED_SLICE

    def _failed(self, exc: Exception | None) -> None:
        """The response cannot be read: malformed (`exc`), or a head over the bound (None).
        The pieces of body parsed before the fault go to the sink first, as they came."""
        sink, self.sink = self.sink, None
        bodies = self._bodies
        if bodies:
            if sink is not None:
                for body in bodies:
                    sink.on_body(body)
            bodies.clear()
        if self.transport is not None:
            self.transport.abort()
        if sink is not None:
            address = self.upstream.address
            if exc is None:
                reason = f"response head from {address} over {MAX_RESPONSE_HEAD} bytes"
            else:
                reason = f"malformed response from {address}: {exc}"
            sink.on_failure(UpstreamError(reason))

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        # (an upstream sending header lines or interim responses without end: bounded)
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_RESPONSE_HEAD:
            raise ValueError("response head too large")  # (the parser stops: see data_received)
        self._headers.append((name, value))
        size = len(name)
        if size == 17 or size == 14:  # (only these two names are read here: no other lowered)
            lname = name.lower()
            if lname == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif lname == b"content-length":
                self._has_length = True

    def on_message_begin(self) -> None:
        if self.sink is None and self.transport is not None:
            # A response nobody asked for, in the packet of the last one: the connection is
            # out of step (its next request would get these bytes), never to be reused.
            self.upstream.forget(self)
            self.transport.close()

    def on_headers_complete(self) -> None:
        sink = self.sink
        if sink is None:
            return
        chunked = self._chunked
        status = self.parser.get_status_code()
        if status < 200:
            self._interim_head(sink, status)
            return
        self._in_head = False
        bodiless = status == 204 or status == 304  # (no body, whatever the head says: RFC 9112)
        self._until_eof = not (chunked or self._has_length or bodiless)
        if not sink.on_head(status, self._headers, (chunked or self._until_eof) and not bodiless):
            self.abort()

    def _interim_head(self, sink: ResponseSink, status: int) -> None:
        """A 1xx response (100 Continue, 103 Early Hints): not relayed; the final one follows.
        A failure (the connection closed, not pooled in an unknown state): a 101 (`Upgrade` is
        never forwarded), a status under 100 (invalid), a 1xx declaring a body (it has none:
        RFC 9110 §15.2; httptools reads it, and its bytes reached the client unframed)."""
        framed, self._headers = self._chunked or self._has_length, []
        self._chunked = self._has_length = False
        if status == 101 or status < 100 or framed:
            self.abort()
            what = "switched protocols unasked" if status == 101 else f"answered status {status}"
            sink.on_failure(UpstreamError(f"{self.upstream.address} {what}"))
            return
        self._interim = True

    def on_message_complete(self) -> None:
        if self._interim:  # the end of a 1xx response: the same sink awaits the final one
            self._interim = False
            return
        sink, self.sink = self.sink, None
        self._until_eof = False
        if sink is None:
            return
        bodies = self._bodies
        if bodies:  # (the last pieces, in the packet of the end: written with it)
            for body in bodies:
                sink.on_body(body)
            bodies.clear()
        keep_alive = self.parser.should_keep_alive() and self._held_pos >= len(self._held)
        sink.on_complete()
        if keep_alive and self.transport is not None and not self.transport.is_closing():
            self.reused = True
            if self._paused:
                self.resume_reading()
            self.upstream.release(self)
        elif self.transport is not None:
            self.transport.close()
