"""Small GETs over the gateway's own keep-alive connections: a fleet's metadata files.

At a cold start a frontend downloads two or three files for each model of its fleet
(20,000 at 10,000 models). A GET through a general client library costs ~300 us of CPU;
through `UpstreamConnection` (httptools, one write, no per-request objects beyond a sink)
about a quarter of that. `Fetcher` takes plain `http://` URLs whose target is printable
ASCII; `Fetcher.handles(url)` says which, and the caller uses a general client for the rest
(HTTPS, odd URLs) and for large files.

Connections are pooled per `host:port` (at most `per_host` open at once per host, so one
worker's status server is never asked for a thousand files at a time), and a request that
met a stale keep-alive connection (closed by the server before answering) is tried once
more on a new one, as general clients do.
"""

from __future__ import annotations

import asyncio
import re
import urllib.parse
from collections import OrderedDict

from shoal.frontend.http.exchange import UpstreamError
from shoal.frontend.http.upstream import Upstream, UpstreamConnection

_PLAIN_TARGET = re.compile(r"/[\x21-\x7e]*")
_PLAIN_NETLOC = re.compile(
    r"(?:[^@/?#\s]+@)?(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?"
)
"""A request target sent as it is: printable ASCII, no space (anything else is a general
client's to encode)."""
MAX_HOSTS = 1024
"""Hosts whose connections are kept; past that the least recently used one's are closed."""


class FetchError(Exception):
    """The GET failed: no answer, a broken one, a status other than 200, or too many bytes."""


class _Body:
    """A `ResponseSink`: collects one response's body (at most `limit` bytes) and resolves `done` at its end."""

    __slots__ = ("chunks", "done", "limit", "size", "status", "too_large")

    def __init__(self, done: asyncio.Future[None], limit: int) -> None:
        self.done = done
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit = limit
        self.status = 0  # 0 until the head came
        self.too_large = False

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], chunked: bool) -> bool:
        self.status = status
        if status != 200:
            self._end(FetchError(f"answered {status}"))
            return False
        return True

    def on_body(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            self.too_large = True
            raise ValueError("body too large")  # the parser stops; on_failure follows
        self.chunks.append(data)

    def on_packet(self, bodies: list[bytes]) -> None:
        for data in bodies:
            self.on_body(data)

    def on_complete(self) -> None:
        self._end(None)

    def on_failure(self, exc: Exception) -> None:
        if self.too_large:
            self._end(FetchError(f"is larger than {self.limit} bytes"))
        else:
            self._end(exc)

    def _end(self, exc: Exception | None) -> None:
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)


class _Host:
    __slots__ = ("slots", "upstream")

    def __init__(self, upstream: Upstream, per_host: int) -> None:
        self.upstream = upstream
        self.slots = asyncio.Semaphore(per_host)


class Fetcher:
    """GETs of small files over pooled keep-alive HTTP/1.1 connections, `per_host` at a time."""

    def __init__(self, *, connect_timeout: float = 5.0, per_host: int = 32) -> None:
        self.connect_timeout = connect_timeout
        self.per_host = per_host
        self._hosts: OrderedDict[str, _Host] = OrderedDict()

    @staticmethod
    def handles(url: str) -> bool:
        """`url` is plain `http://host[:port]/target` with a printable-ASCII target."""
        if not url.startswith("http://"):
            return False
        parts = urllib.parse.urlsplit(url)
        target = parts.path + ("?" + parts.query if parts.query else "")
        try:
            parts.port  # noqa: B018 (raises for a port that is not a number)
        except ValueError:
            return False
        return (
            _PLAIN_NETLOC.fullmatch(parts.netloc) is not None
            and _PLAIN_TARGET.fullmatch(target or "/") is not None
        )

    async def get(self, url: str, max_bytes: int, timeout: float) -> bytes:
        """The body of `url` (answered 200, at most `max_bytes`); `FetchError` otherwise.

        `timeout` bounds the request once it has its turn among the host's `per_host`, not
        the wait for that turn: a cold start queues thousands of files for one host, and the
        last of them is not late. A cancellation drops the connection in use."""
        parts = urllib.parse.urlsplit(url)
        target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
        host = self._host(f"http://{parts.netloc}")
        upstream = host.upstream
        auth = (
            b""
            if upstream.authorization is None
            else b"Authorization: " + upstream.authorization + b"\r\n"
        )
        head = b"GET %s HTTP/1.1\r\nHost: %s\r\nAccept: */*\r\n%s\r\n" % (
            target.encode("ascii"),
            upstream.host_header,
            auth,
        )
        async with host.slots:
            try:
                async with asyncio.timeout(timeout):
                    return await self._exchange(upstream, head, max_bytes)
            except TimeoutError:
                raise FetchError(f"timed out after {timeout:g}s") from None

    @staticmethod
    async def _exchange(upstream: Upstream, head: bytes, max_bytes: int) -> bytes:
        """Send `head` on a pooled connection and read the answer (once more on a new
        connection when a pooled one turns out closed)."""
        for attempt in (0, 1):
            conn = upstream.take_idle()
            reused = conn is not None
            if conn is None:
                try:
                    conn = await upstream.connect()
                except UpstreamError as exc:  # (refused, reset, timed out)
                    raise FetchError(str(exc)) from None
            body = _Body(asyncio.get_running_loop().create_future(), max_bytes)
            conn.send(head, b"", body)
            try:
                await body.done
            except FetchError:
                raise
            except UpstreamError as exc:
                if reused and attempt == 0 and body.status == 0 and not body.chunks:
                    continue  # a keep-alive connection the server had closed: once more
                raise FetchError(str(exc)) from None
            except BaseException:
                _drop(conn)
                raise
            return b"".join(body.chunks)
        raise AssertionError("unreachable")  # pragma: no cover

    def _host(self, base: str) -> _Host:
        host = self._hosts.get(base)
        if host is None:
            upstream = Upstream(0, base, connect_timeout=self.connect_timeout)
            host = self._hosts[base] = _Host(upstream, self.per_host)
            if len(self._hosts) > MAX_HOSTS:
                _, oldest = self._hosts.popitem(last=False)
                oldest.upstream.close()  # (its requests in flight finish; the rest reconnect)
        else:
            self._hosts.move_to_end(base)
        return host

    def close(self) -> None:
        for host in self._hosts.values():
            host.upstream.close()
        self._hosts.clear()


def _drop(conn: UpstreamConnection) -> None:
    """A request abandoned mid-way (timeout, cancellation): its connection is not reused."""
    conn.abort()
