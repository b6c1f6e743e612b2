"""What one client may cost the gateway: request head size and header count (431), time to
send a head or a body (408), and concurrent connections (503), all refused in the OpenAI
error format while everyone else is served as usual."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, cast

from shoal.frontend.http.server import HttpConnection
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import raw_exchange, serving
from tests.helpers import wait_for

LIVE = b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n"


def error_of(response: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(response.partition(b"\r\n\r\n")[2])["error"]
    return error


async def read_until_closed(reader: asyncio.StreamReader, timeout: float = 10.0) -> bytes:
    received = b""
    async with asyncio.timeout(timeout):
        while chunk := await reader.read(65536):
            received += chunk
    return received


async def test_huge_header_line_is_431_before_the_body_is_read(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend()
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        # The body is declared and never sent: the answer cannot wait for it.
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n"
            + b"X-Big: " + b"a" * 200_000 + b"\r\n\r\n"
        )  # fmt: skip
        received = await read_until_closed(reader)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 431 ")
    assert b"connection: close" in received
    assert error_of(received)["code"] == "request_header_fields_too_large"


async def test_too_many_headers_is_431(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend()
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(20_000))
    received = await raw_exchange(frontend.port, b"GET /live HTTP/1.1\r\n" + headers + b"\r\n")
    assert received.startswith(b"HTTP/1.1 431 ")
    assert error_of(received)["code"] == "request_header_fields_too_large"


async def test_header_limits_are_configurable(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend(max_headers=3, max_header_size=200)
    three = b"GET /live HTTP/1.1\r\nHost: t\r\nA: 1\r\nB: 2\r\n\r\n"
    assert (await raw_exchange(frontend.port, three)).startswith(b"HTTP/1.1 200 ")
    four = b"GET /live HTTP/1.1\r\nHost: t\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n"
    refused = await raw_exchange(frontend.port, four)
    assert refused.startswith(b"HTTP/1.1 431 ")
    assert "more than 3 headers" in error_of(refused)["message"]
    long = b"GET /live HTTP/1.1\r\nHost: t\r\nA: " + b"x" * 200 + b"\r\n\r\n"
    assert (await raw_exchange(frontend.port, long)).startswith(b"HTTP/1.1 431 ")


async def test_head_sent_too_slowly_is_408_and_closed(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend(header_timeout=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(b"GET /live HTTP/1.1\r\n")
        received = b""
        async with asyncio.timeout(10):
            while not received:  # one header line at a time, never the end of the head
                writer.write(b"X-Slow: 1\r\n")
                with contextlib.suppress(TimeoutError):
                    received = await asyncio.wait_for(reader.read(65536), 0.1)
            received += await read_until_closed(reader)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 408 ")
    assert error_of(received)["code"] == "request_timeout"


async def test_connection_that_sends_nothing_is_closed_after_the_header_timeout(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(header_timeout=0.3)
    reader, _writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    assert await read_until_closed(reader) == b""


async def test_body_stalled_between_bytes_is_408_and_closed(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend(body_timeout=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{"
        )
        received = await read_until_closed(reader)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 408 ")
    assert "body" in error_of(received)["message"]


async def test_connections_over_the_cap_get_503_until_one_closes(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(max_connections=3)
    assert frontend.server is not None
    held = [await asyncio.open_connection("127.0.0.1", frontend.port) for _ in range(3)]
    try:
        for reader, writer in held:  # each one is served
            writer.write(LIVE)
            assert (await reader.readuntil(b'"ok"}')).startswith(b"HTTP/1.1 200 ")
        reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
        refused = await read_until_closed(reader)
        writer.close()
        assert refused.startswith(b"HTTP/1.1 503 ")
        assert error_of(refused)["code"] == "too_many_connections"
        held.pop()[1].close()
        await wait_for(lambda: len(frontend.server.connections) < 3)  # type: ignore[union-attr]
        assert (await raw_exchange(frontend.port, LIVE)).startswith(b"HTTP/1.1 200 ")
    finally:
        for _, w in held:
            w.close()


SLOW_CLIENTS = 300  # modest: the test box has 2 cores shared with other test runs


async def test_slow_loris_connections_neither_delay_others_nor_stay_open(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """300 clients each sending one header line every 0.2 s: while they are connected, a
    normal request and a proxied one are answered promptly; each slow client gets 408 and
    is closed once the header timeout passes."""
    await start_worker()
    frontend = await start_frontend(header_timeout=2.0)
    await wait_for(lambda: serving(frontend))
    connected = 0
    stop = asyncio.Event()

    async def slow_client() -> bytes:
        nonlocal connected
        reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
        connected += 1
        try:
            writer.write(b"GET /live HTTP/1.1\r\nHost: t\r\n")
            read = asyncio.ensure_future(reader.read(65536))
            while not read.done() and not stop.is_set():
                writer.write(b"X-Slow: 1\r\n")
                await asyncio.wait([read], timeout=0.2)
            return (await read) + await read_until_closed(reader) if read.done() else b""
        except ConnectionError:
            return b"reset"
        finally:
            writer.close()

    clients = [asyncio.create_task(slow_client()) for _ in range(SLOW_CLIENTS)]
    try:
        await wait_for(lambda: connected == SLOW_CLIENTS, timeout=10)
        body = b'{"model":"mock-llm","messages":[]}'
        chat = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (
            len(body),
            body,
        )
        for request in (LIVE, chat, LIVE):
            started = time.perf_counter()
            response = await raw_exchange(frontend.port, request)
            latency = time.perf_counter() - started
            assert response.startswith(b"HTTP/1.1 200 "), response[:200]
            assert latency < 1.0, f"answered in {latency:.2f}s beside {SLOW_CLIENTS} slow clients"
        async with asyncio.timeout(15):
            answers = await asyncio.gather(*clients)
    finally:
        stop.set()
        for task in clients:
            task.cancel()
    timed_out = sum(1 for a in answers if a.startswith(b"HTTP/1.1 408 "))
    assert timed_out == SLOW_CLIENTS, {a[:40] for a in answers}


async def test_a_sweep_over_many_connections_lets_the_event_loop_turn_between_slices() -> None:
    """The sweep checked every connection in one callback: 4,000 slow heads timing out at
    once (each answered 408 in its check) held the loop ~150 ms. It checks a slice of
    `TURN_SECONDS` at a time, the rest in the loop's next turns, each connection once."""
    from shoal.frontend.http.listener import TURN_SECONDS, HttpServer

    loop = asyncio.get_running_loop()
    turns = 0

    def tick() -> None:  # (one increment per turn of the loop)
        nonlocal turns
        turns += 1
        loop.call_soon(tick)

    seen: list[int] = []
    times: set[float] = set()

    class Slow:
        """A connection whose check costs half a millisecond (a 408 written and closed)."""

        idle, transport = True, None

        def check_deadlines(self, now: float) -> None:
            seen.append(turns)
            times.add(now)
            end = time.perf_counter() + 0.0005
            while time.perf_counter() < end:
                pass

    server = HttpServer(lambda _, conn: None, max_body=1000)
    slow = [Slow() for _ in range(200)]  # 100 ms of work in all
    server.connections.update(cast(list[HttpConnection], slow))
    loop.call_soon(tick)
    try:
        server._sweep()
        await wait_for(lambda: len(seen) >= len(slow), message="all checked")
        per_turn = max(seen.count(t) for t in set(seen))
        assert per_turn <= TURN_SECONDS / 0.0005 + 32, per_turn  # (checked in steps of 32)
        assert len(set(seen)) >= 3
        assert len(seen) == len(slow) and len(times) == 1  # each once, all against one time
    finally:
        server.connections.clear()
        await server.close(0)
