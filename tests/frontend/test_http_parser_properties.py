"""Property test of the request parser and the connection's answers: whatever bytes arrive,
split wherever, pipelined however, the server answers only well-formed HTTP/1.1 responses,
never a 500, never hangs (it closes once the client half-closes), logs no error, and a new
connection is served afterwards. Well-formed pipelined requests each get their answer."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import socket
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.discovery import Discovery
from shoal.frontend import Frontend, FrontendConfig
from shoal.store import open_store
from tests.frontend.support import FakeWorker, serving
from tests.helpers import wait_for

STATUS_LINE = re.compile(rb"HTTP/1\.1 ([1-5]\d\d) [^\r\n]*\r\n")
HEADER_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+: [^\r\n]*")
CHAT = b'{"model":"mock-llm","messages":[{"role":"user","content":"hi"}]}'


class ServedFrontend:
    """A frontend and a fake worker on their own uvloop in a thread (as in production), so
    that the property test can drive them with plain blocking sockets."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.loop = uvloop.new_event_loop()
        self.errors: list[str] = []
        self.port = 0
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def _record(self, _loop: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        """Record the loop's errors, except a task of another test's client (not shoal's
        code) that the garbage collector happens to finalise while this loop runs."""
        get_coro = getattr(ctx.get("future"), "get_coro", None)
        code = getattr(get_coro() if get_coro else None, "cr_code", None)
        if code is not None and f"{os.sep}shoal{os.sep}" not in code.co_filename:
            return
        self.errors.append(str(ctx))

    def start(self) -> None:
        self.loop.set_exception_handler(self._record)
        self._thread.start()
        self.run(self._start())

    async def _start(self) -> None:
        self.store = await open_store(f"memory://{uuid.uuid4().hex}")
        self.worker = await FakeWorker().start()
        await self.worker.register(self.store)
        config = FrontendConfig(port=0, cache_dir=self.cache_dir, drain_timeout=1.0)
        self.frontend = Frontend(config, discovery=Discovery(self.store))
        await self.frontend.start()
        self.port = self.frontend.port
        await wait_for(lambda: serving(self.frontend))

    def stop(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    async def _stop(self) -> None:
        await self.frontend.stop()
        await self.worker.stop()
        await self.store.close()


class ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedFrontend, ErrorLog]]:
    server = ServedFrontend(tmp_path_factory.mktemp("cache"))
    errors = ErrorLog()
    logging.getLogger("shoal").addHandler(errors)
    server.start()
    try:
        yield server, errors
    finally:
        server.stop()
        logging.getLogger("shoal").removeHandler(errors)


# -- what clients send ---------------------------------------------------------------------

PATHS = [b"/live", b"/health", b"/metrics", b"/v1/models", b"/v1/models/mock-llm",
         b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings", b"/nope?x=1",
         b"/v1/models/%zz"]  # fmt: skip
header = st.tuples(
    st.from_regex(r"X-[A-Za-z0-9-]{1,12}", fullmatch=True),
    st.from_regex(r"[ -~]{0,30}", fullmatch=True).map(str.strip),
).map(lambda h: f"{h[0]}: {h[1]}\r\n".encode())


@st.composite
def valid_request(draw: st.DrawFn) -> bytes:
    """A well-formed HTTP/1.1 keep-alive request (HEAD left out: its answers have no body)."""
    method = draw(st.sampled_from([b"GET", b"POST", b"OPTIONS", b"DELETE", b"PUT"]))
    path = draw(st.sampled_from(PATHS))
    body = draw(st.one_of(st.just(CHAT), st.binary(max_size=200), st.just(b"")))
    head = b"%s %s HTTP/1.1\r\nHost: t\r\n" % (method, path) + b"".join(
        draw(st.lists(header, max_size=5))
    )
    if draw(st.booleans()):
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"


@st.composite
def mutated_request(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(valid_request()))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if action == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        else:
            del data[at:]
    return bytes(data)


garbage = st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from([b"GET", b" ", b"/", b"HTTP/1.1", b"HTTP/1.0", b"\r\n", b":",
                              b"Content-Length: ", b"Transfer-Encoding: chunked", b"0", b"ff",
                              b"Connection: close", b"Upgrade: h2c", b"Expect: 100-continue"]),
             max_size=30).map(b"".join),
)  # fmt: skip


LAST = b"GET /live HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


# -- what the server answers ---------------------------------------------------------------


def parse_responses(data: bytes) -> list[tuple[int, bytes]]:
    """Every response in `data`, strictly framed; fails on anything that is not HTTP/1.1."""
    responses = []
    pos = 0
    while pos < len(data):
        match = STATUS_LINE.match(data, pos)
        assert match, f"not a status line at {pos}: {data[pos : pos + 80]!r}"
        status = int(match.group(1))
        end = data.index(b"\r\n\r\n", match.start()) + 4
        lines = data[match.end() : end - 4].split(b"\r\n") if end - 4 > match.end() else []
        headers = {}
        for line in lines:
            assert HEADER_LINE.fullmatch(line), f"bad header line {line!r}"
            name, _, value = line.partition(b": ")
            headers[name.lower()] = value
        pos = end
        if status < 200:
            continue  # 100 Continue
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size_end = data.index(b"\r\n", pos)
                size = int(data[pos:size_end], 16)
                body += data[size_end + 2 : size_end + 2 + size]
                assert data[size_end + 2 + size : size_end + 4 + size] == b"\r\n"
                pos = size_end + 4 + size
                if size == 0:
                    break
        elif b"content-length" in headers:
            length = int(headers[b"content-length"])
            body = data[pos : pos + length]
            assert len(body) == length, "response cut short"
            pos += length
        elif status == 204:
            body = b""
        else:
            body, pos = data[pos:], len(data)  # ended by the close
        responses.append((status, body))
    return responses


def exchange(port: int, pieces: list[bytes], half_close: bool = True) -> bytes:
    """Send the pieces one segment each, half-close (unless not: then the last piece ends
    the connection), and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for piece in pieces:
                sock.sendall(piece)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server already answered and closed: what it sent is still readable
        received = b""
        try:
            while chunk := sock.recv(65536):  # a timeout here is a hang: the test fails
                received += chunk
        except ConnectionResetError:
            pass
        return received


def check_served(
    served: tuple[ServedFrontend, ErrorLog], received: bytes
) -> list[tuple[int, bytes]]:
    server, errors = served
    responses = parse_responses(received)
    for status, body in responses:
        assert b"Internal error in the gateway" not in body, (status, body)
    assert not errors.records, errors.records
    assert not server.errors, server.errors
    after = exchange(server.port, [b"GET /live HTTP/1.1\r\nConnection: close\r\n\r\n"])
    assert [status for status, _ in parse_responses(after)] == [200]
    # Every body byte a connection took of the server's budget, it gave back (`shared.py`).
    bodies = server.frontend.server.bodies
    server.run(wait_for(lambda: bodies.held == 0, message=f"bodies held: {bodies.held}"))
    return responses


PROPERTY = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@PROPERTY
@given(
    requests=st.lists(
        st.one_of(valid_request(), mutated_request(), garbage), min_size=1, max_size=4
    ),
    cuts=st.lists(st.integers(0, 10_000), max_size=6),
)
def test_any_bytes_get_well_formed_answers_and_the_server_survives(
    served: tuple[ServedFrontend, ErrorLog], requests: list[bytes], cuts: list[int]
) -> None:
    data = b"".join(requests)
    check_served(served, exchange(served[0].port, split(data, cuts)))


@PROPERTY
@given(
    requests=st.lists(valid_request(), min_size=1, max_size=5),
    cuts=st.lists(st.integers(0, 10_000), max_size=6),
)
def test_every_pipelined_valid_request_gets_one_answer_in_order(
    served: tuple[ServedFrontend, ErrorLog], requests: list[bytes], cuts: list[int]
) -> None:
    # The last asks the server to close: a half-close is a client gone for what is still
    # being answered (a proxied request, `/metrics`), as nginx and vLLM's server take it.
    pieces = [*split(b"".join(requests), cuts), LAST]
    responses = check_served(served, exchange(served[0].port, pieces, half_close=False))
    assert len(responses) == len(requests) + 1
    for status, body in responses:  # (a 400 for a body that is not JSON is right)
        assert b"Malformed HTTP request" not in body and status not in (408, 413, 431, 501)
