"""What a request handler sees of the HTTP server: the parsed `Request`, the
`ClientConnection` a response produced later answers through (and the `FlowListener` and
`InFlight` it hands over), and the encoding of a response head.
"""

from __future__ import annotations

import asyncio
import http
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import msgspec

from shoal.openai import ApiError


class Request:
    """One parsed request. Header names are lower-cased bytes; the body is complete: `body`,
    joined when first read if it came as pieces (`BodyPieces.whole`: a large body's, read first
    in the decoder's thread, where the join lets go of the GIL for its copy), and its `size`
    (as the client sent it, when the gateway rewrote it)."""

    __slots__ = (
        "_body",
        "_pieces",
        "headers",
        "http11",
        "keep_alive",
        "members",
        "method",
        "path",
        "query",
        "received",
        "refused",
        "size",
        "too_deep",
    )

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | list[bytes],
        *,
        keep_alive: bool,
        http11: bool,
    ) -> None:
        if target[:1] != b"/":  # (absolute-form, RFC 9112 §3.2.2: served as its path)
            target = origin_form(target)
        path, _, query = target.partition(b"?")
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        if isinstance(body, list):
            self._body: bytes | None = None
            self._pieces: list[bytes] | None = body
            self.size = sum(map(len, body))
        else:
            self._body, self._pieces = body, None
            self.size = len(body)
        self.keep_alive = keep_alive
        self.http11 = http11
        self.received = time.perf_counter()
        # A large body's nesting, judged as it arrived (`bounds.DepthMeter`): whether it is
        # deeper than `bounds.MAX_DEPTH`; None when not judged (a small body: the decoder's
        # caller checks it, at little cost).
        self.too_deep: bool | None = None
        # A large body's top-level members, each as its JSON text, when they were decoded
        # with its fields (`proxy.fields.fields_later`): a body rebuilt from them (a virtual
        # model's rename, a disaggregated request's stages) is not parsed again.
        self.members: dict[str, msgspec.Raw] | None = None
        # What the server answers it, not the handler: refused on its head (`head.Verdict`).
        self.refused: ApiError | None = None

    @property
    def body(self) -> bytes:
        pieces = self._pieces  # (first: a thread that joins them sets `_body`, then drops them)
        body = self._body
        if body is None:
            assert pieces is not None
            body = self._body = b"".join(pieces)
            self._pieces = None
        return body

    def rewrite(self, body: bytes) -> None:
        """Forward `body` in place of the client's: the gateway's rewrite of it, before any
        attempt (`Proxy.ask_usage`); `size` stays the client's."""
        self._body, self._pieces = body, None

    def with_headers(self, headers: list[tuple[bytes, bytes]]) -> Request:
        """This request with other header lines (made field by field: a compiled build's
        classes do not go through `copy.copy`)."""
        other = Request(self.method, self.path, headers, self.body, keep_alive=False, http11=False)
        other.query, other.keep_alive, other.http11 = self.query, self.keep_alive, self.http11
        other.received, other.too_deep = self.received, self.too_deep
        other.members = self.members
        return other

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


def origin_form(target: bytes) -> bytes:
    """The path and query of a request target in absolute-form (`http://host/path?q`, which
    a server must accept: RFC 9112 §3.2.2); any other target as it is (`*`, CONNECT's)."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return target
    ends = [i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0]
    tail = rest[min(ends) :] if ends else b""
    return tail if tail[:1] == b"/" else b"/" + tail


SMALL_PIECE = 512  # a piece of a body smaller than this is gathered with the next ones
GATHERED = 64 * 1024  # into one piece of about this size
GATHER_FROM = 64  # once a body has this many pieces


class BodyPieces:
    """A request body as it comes: its pieces, small ones gathered. A body in chunks of one
    byte each is millions of pieces otherwise: 10 MB of them held 900 MB, and their join the
    event loop a second."""

    __slots__ = ("_tail", "pieces")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []  # (small ones not yet among them: see `joined`)
        self._tail = bytearray()

    def reset(self) -> None:
        """Empty, for the next body (one per connection: none made per request)."""
        self.pieces = []
        if self._tail:
            self._tail.clear()

    def add(self, piece: bytes) -> None:
        tail = self._tail
        if not tail and (len(self.pieces) < GATHER_FROM or len(piece) >= SMALL_PIECE):
            self.pieces.append(piece)  # (the usual body: a piece or a few, as they came)
            return
        if len(piece) < SMALL_PIECE:
            tail += piece
            if len(tail) < GATHERED:
                return
            piece = bytes(tail)
            tail.clear()
        elif tail:
            self.pieces.append(bytes(tail))
            tail.clear()
        self.pieces.append(piece)

    def joined(self) -> bytes:
        """The whole body (every piece among `pieces` from now on)."""
        body = self.whole(-1)
        assert isinstance(body, bytes)
        return body

    def whole(self, join_from: int) -> bytes | list[bytes]:
        """The whole body (every piece among `pieces` from now on): joined, or those pieces
        when they are `join_from` bytes or more (-1: never), for `Request.body` to join when
        first read: joining 30 MB held the event loop 4-50 ms (the copy, and the faults of
        its fresh pages), a thread's join lets go of the GIL."""
        pieces = self.pieces
        if self._tail:
            pieces.append(bytes(self._tail))
            self._tail.clear()
        if len(pieces) == 1:
            return pieces[0]
        if join_from >= 0 and sum(map(len, pieces)) >= join_from:
            return pieces  # (`reset` makes a new list: the request's stays as it is)
        return b"".join(pieces)


class FlowListener(Protocol):
    """What is told to stop producing while the client's send buffer is full."""

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class InFlight(Protocol):
    """A response being produced after the handler returned; told if the client goes away."""

    def cancel(self) -> None: ...


class BodyBudget:
    """Bytes of request bodies held (`held`), at most `limit` (`take` says whether they fit).

    Invariant: `held` is the sum, over the server's connections, of the body being read and
    the bodies of requests parsed and not yet handed to the handler; a connection gives back
    what it took when it hands a request on, and all it still holds when it stops or closes.
    """

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        """Count `size` more bytes held; False if they cross the limit (counted all the same:
        the connection gives them back with the rest of its body)."""
        self.held += size
        return self.held <= self.limit

    def give(self, size: int) -> None:
        self.held -= size

    def hold(self, size: int) -> bool:
        """Count `size` bytes of a body handed on that still waits, whole (a large one, for
        the decoder's one thread: `fields.InThread`), if they fit; else count nothing."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def let_go(self, reading: int, waiting: deque[Request] | None) -> None:
        """Give back `reading` bytes (a body no more read), and the bodies of the requests
        `waiting` if given (emptied: they are dropped, never answered)."""
        if waiting:
            reading += sum(request.size for request in waiting)
            waiting.clear()
        self.held -= reading


class ClientConnection(Protocol):
    """The client connection as a response produced later (the proxy's) sees it, and all
    that response may do with it. The connection's state (pipeline, flow control, keep-alive)
    stays its own: `HttpConnection` implements this."""

    loop: asyncio.AbstractEventLoop  # the loop the connection runs on, for timers

    @property
    def keep_alive(self) -> bool:
        """Whether the connection carries another request after this response."""
        ...

    @property
    def writable(self) -> bool: ...

    @property
    def bodies(self) -> BodyBudget:
        """The server's budget of request bodies (a body waiting for its decode counts)."""
        ...

    def produce_later(self, work: InFlight) -> None: ...
    def follow(self, flow: FlowListener | None) -> None: ...
    def close_after_response(self) -> None: ...
    def write(self, data: bytes) -> None: ...
    def write_if_open(self, data: bytes) -> bool:
        """`write` unless the connection is closed or closing (`writable`), in one call (a
        stream's every event); whether it wrote."""
        ...

    def finish(self, error: ApiError | None = None) -> None: ...
    def send_error(self, error: ApiError) -> None: ...


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
    keep_alive: bool = True,
    extra: bytes = b"",
    head_only: bool = False,
    length: int | None = None,
) -> bytes:
    """A whole response. `extra`: encoded header lines added as they are; `head_only`: the
    answer to HEAD (the head a GET would get, without its body); `length`: the body's, when
    it is written apart (`body` empty)."""
    if status != 204:
        length_text = str(len(body) if length is None else length).encode()
        parts = [status_line(status), b"content-type: ", content_type, b"\r\ncontent-length: ", length_text, b"\r\n"]  # fmt: skip
    else:
        parts = [status_line(status)]  # no content (RFC 9110 §8.6)
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if extra:
        parts.append(extra)
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts += (b"\r\n", b"" if head_only else body)
    return b"".join(parts)


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` value, the scheme in any case (RFC 9110
    §11.1); None for another scheme or none."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None
