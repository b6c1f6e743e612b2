"""What the gateway's HTTP server holds a request head to (`HttpConnection`, server.py): its
size and header count (431), a declared body over `max_body` (413), a framing it cannot trust
(Transfer-Encoding other than chunked: 501; on HTTP/1.0: 400, RFC 9112 §6.1), the handler's
`head_check` (a request without a valid key: 401 before its body is buffered; the body bound
of a request to a route that reads none), and what the
server itself acts on (`Expect: 100-continue`, `Upgrade`).

A refused head whose body is declared and small (`DRAINED_BODY`, no `Expect` or `Upgrade`)
is answered once its body is read and dropped, on a connection that stays open: the client
retries on it with its key. Any other is answered at once, and its connection closed (a
chunked body could run on, an awaited one never come).

Trailer fields (after a chunked body) are never merged into the head: they are dropped, as
RFC 9110 §6.5.1 allows, and bounded like a head: `max_headers` fields, and `max_header_size`
bytes of chunk framing and trailer section between two body bytes (`HttpConnection._feed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import httptools

from shoal.frontend.http import errors
from shoal.openai import ApiError

DRAINED_BODY = 64 * 1024  # a refused request's body up to this long is read and dropped

# The request headers the server itself reads (the handler reads the others).
_READ_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"expect", b"upgrade"})

HeadCheck = Callable[[bytes, bytes, list[tuple[bytes, bytes]]], ApiError | int]
"""The handler's own verdict on a request head (method, target, headers), before its body is
read: what it would refuse anyway, whatever the body (a request without a valid key), or the
most body bytes it reads of this request (`max_body`, or fewer: a route that reads none)."""


class Limits(Protocol):
    """What a head is held to (`HttpServer`'s settings)."""

    max_body: int
    max_header_size: int
    max_headers: int
    head_check: HeadCheck | None


class Verdict(NamedTuple):
    """A request head judged (`judge_head`)."""

    error: ApiError | None  # what it is refused with, if it is
    expect_continue: bool  # it asks for `100 Continue`
    upgrade: bool  # it asks for an `Upgrade` (ignored: `without_upgrade`)
    max_body: int | None = None  # the most body bytes read of it (None: `Limits.max_body`)
    refused: ApiError | None = None  # its answer once its body is read and dropped (kept open)


_PLAIN = Verdict(None, False, False)  # (most heads: made once, not per request)


def judge_head(
    parser: httptools.HttpRequestParser,
    url: bytes,
    headers: list[tuple[bytes, bytes]],
    limits: Limits,
) -> Verdict:
    """The complete request head `parser` read (names lower-cased) judged."""
    if len(headers) > limits.max_headers:
        return Verdict(
            errors.headers_too_large(f"more than {limits.max_headers} headers"), False, False
        )
    size = len(url)
    expect_continue = upgrade = chunked = False
    declared = 0
    for name, value in headers:
        size += len(value)
        if name in _READ_HEADERS:
            if name == b"content-length":
                if (declared := int(value)) > limits.max_body:
                    return Verdict(errors.body_too_large(limits.max_body), False, False)
            elif name == b"transfer-encoding":
                if parser.get_http_version() == "1.0":  # (a front proxy would frame it otherwise)
                    why = "Transfer-Encoding in an HTTP/1.0 request: its framing is not trusted."
                    return Verdict(errors.bad_request(why), False, False)
                if value.strip().lower() != b"chunked":
                    return Verdict(errors.unsupported_coding(value), False, False)
                chunked = True
            elif name == b"expect":
                expect_continue = value.lower() == b"100-continue"
            else:
                upgrade = bool(parser.should_upgrade())
    if size > limits.max_header_size:  # (names: bounded by the check on each read)
        return Verdict(
            errors.headers_too_large(f"over {limits.max_header_size} bytes"), False, False
        )
    check = limits.head_check
    if check is not None:
        verdict = check(parser.get_method(), url, headers)
        if isinstance(verdict, ApiError):
            if declared <= DRAINED_BODY and not (chunked or expect_continue or upgrade):
                return Verdict(None, False, False, declared, verdict)  # (the connection stays)
            return Verdict(verdict, False, False)  # (its body is never read: dropped, then close)
        if verdict < limits.max_body:  # (a chunked body: held to it as it comes)
            if declared > verdict:
                return Verdict(errors.body_too_large(verdict), False, False)
            return Verdict(None, expect_continue, upgrade, verdict)
    return Verdict(None, expect_continue, upgrade) if expect_continue or upgrade else _PLAIN


def refused_trailers(count: int, size: int, limits: Limits) -> ApiError | None:
    """What a request is refused with once it sent `count` trailer fields of `size` bytes
    (names and values), if anything."""
    if count > limits.max_headers:
        return errors.headers_too_large(f"more than {limits.max_headers} trailer fields")
    if size > limits.max_header_size:
        return errors.headers_too_large(f"trailer section over {limits.max_header_size} bytes")
    return None


def framing_too_large(limits: Limits) -> ApiError:
    """A chunked body's framing (chunk lines, trailer section) over `max_header_size` bytes
    between two of its body bytes."""
    return errors.headers_too_large(
        f"chunk framing or trailer section over {limits.max_header_size} bytes"
    )


def without_upgrade(
    method: bytes, url: bytes, headers: list[tuple[bytes, bytes]], version: str = "1.1"
) -> bytes:
    """A request head asking for an `Upgrade`, again without it: the server ignores it (RFC
    9110 §7.8 allows it) and a fresh parser reads the request, in its own HTTP `version` (an
    HTTP/1.0 client read as HTTP/1.1 got chunks, and its connection kept alive)."""
    lines = [method, b" ", url, b" HTTP/1.0\r\n" if version == "1.0" else b" HTTP/1.1\r\n"]
    for name, value in headers:
        if name != b"upgrade":
            lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)
