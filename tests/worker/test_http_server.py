"""The worker's aiohttp servers bound their connections: their number, a head's time, a
body's time between its bytes, idle."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from shoal.worker import http_server
from shoal.worker.engines.mocker import MockerEngine
from shoal.worker.http_server import BoundedRunner, start_server
from shoal.worker.runtime import Runtime
from tests.helpers import wait_for
from tests.worker.support import never_reading

GET = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


async def _big(request: web.Request) -> web.Response:
    return web.Response(body=b"x" * (16 << 20))


async def _answer_then_read(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(b"begun")
    await response.write(await request.read())
    return response


@contextlib.asynccontextmanager
async def serving(**limits: float) -> AsyncIterator[tuple[BoundedRunner, int]]:
    app = web.Application()
    app.router.add_get("/ok", _ok)
    app.router.add_post("/echo", _echo)
    app.router.add_post("/answer-then-read", _answer_then_read)
    app.router.add_get("/big", _big)
    runner = await start_server(app, "127.0.0.1", 0, access_log=None, **limits)  # type: ignore[arg-type]
    try:
        yield runner, runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection (what it sent before is skipped)."""
    return await reader.read(65536) == b"" or await closed(reader)


async def test_a_connection_that_sends_no_head_in_time_is_closed_and_one_that_does_is_served() -> (
    None
):
    """aiohttp's defaults kept a connection that sent nothing (or half a head) for 3,630 s:
    1,100 of them used up a 1,024-fd worker. Now a head must arrive within the head timeout
    of the connection's start, or of its first byte after a keep-alive wait."""
    async with serving(max_connections=16, head_timeout=0.2) as (_, port):
        silent_r, silent_w = await asyncio.open_connection("127.0.0.1", port)
        served_r, served_w = await asyncio.open_connection("127.0.0.1", port)
        served_w.write(GET)
        assert (await served_r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert await served_r.readexactly(2) == b"ok"
        served_w.write(GET[:10])  # half a head after a keep-alive wait
        assert await asyncio.wait_for(closed(silent_r), 10)
        assert await asyncio.wait_for(closed(served_r), 10)
        for writer in (silent_w, served_w):
            writer.close()


async def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout() -> None:
    """The keep-alive was aiohttp's 3,630 s; it is the runner's `keepalive_timeout` (75 s by
    default), whatever the head timeout."""
    async with serving(max_connections=16, keepalive_timeout=0.2, head_timeout=60) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(2) == b"ok"
        assert await asyncio.wait_for(closed(reader), 10)
        writer.close()


async def test_a_connection_past_the_limit_is_answered_503_and_closed_and_the_rest_are_served() -> (
    None
):
    """There was no cap on connections. Past `max_connections` a new one is answered
    `503 too_many_connections` (OpenAI format) and closed; a freed place takes one again."""
    async with serving(max_connections=4) as (runner, port):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        server = runner.server
        await wait_for(lambda: server is not None and len(server.connections) == 4)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await asyncio.wait_for(reader.read(), 10)  # to the close
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        assert b'"code":"too_many_connections"' in body.replace(b" ", b""), answer
        assert b"4 connections" in body, answer
        writer.close()
        held_r, held_w = held[0]
        held_w.write(GET)  # the ones held are served
        assert (await held_r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        for _, w in held:
            w.close()
        await wait_for(lambda: server is not None and not server.connections)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_an_answer_its_client_never_reads_is_cut_after_the_send_timeout() -> None:
    """Nothing timed the answer side: a client that asked for a large answer and read none
    of it held its connection for ever (the handler waiting for the buffer to drain), so
    128 of them kept a status server answering 503 to `/live`. Past the send timeout with
    nothing read, the connection is closed and its place is free."""
    async with serving(max_connections=1, send_timeout=0.3) as (runner, port):
        sock = await never_reading(port, "/big")
        server = runner.server
        assert isinstance(server, http_server.BoundedServer)
        try:
            await wait_for(lambda: server.open == 0, message="the unread answer was never cut")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # its place, free
            writer.write(GET)
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            writer.close()
        finally:
            sock.close()


async def test_an_answer_read_slowly_but_steadily_is_not_cut() -> None:
    """The send timeout is a bound on a wait with nothing read, not on the answer's time: a
    client that reads its 16 MiB answer in small pieces, longer in all than the timeout,
    gets all of it."""
    async with serving(max_connections=1, send_timeout=0.5) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
        writer.write(GET.replace(b"/ok", b"/big"))
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        got = 0
        started = asyncio.get_running_loop().time()
        while got < 16 << 20:
            piece = await asyncio.wait_for(reader.read(1 << 20), 10)
            assert piece, f"closed after {got} bytes"
            got += len(piece)
            if got < 4 << 20:
                await asyncio.sleep(0.05)  # (the slow client itself, not a synchronisation)
        assert asyncio.get_running_loop().time() - started > 0.5
        writer.close()


def post_head(path: str, length: int) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()


def openai_error(answer: bytes) -> tuple[bytes, dict[str, str]]:
    """The status line and the error object of a whole answer (read to the close)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)["error"]


async def test_a_body_that_stops_coming_is_answered_408_and_its_connection_place_freed() -> None:
    """Only the head and an idle keep-alive were timed: a body that stopped coming held its
    connection for ever. Past the body timeout with no byte of it (whatever was sent before:
    here 50 bytes, 50 s of allowance at 1 byte/s), the request is answered 408 (OpenAI
    format) and closed, and its place is free."""
    limits = {"head_timeout": 60, "body_timeout": 0.2, "body_min_rate": 1}
    async with serving(max_connections=1, **limits) as (runner, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post_head("/echo", 100) + b"x" * 50)
        status, error = openai_error(await asyncio.wait_for(reader.read(), 10))
        assert status == b"HTTP/1.1 408 Request Timeout", status
        assert error["code"] == "request_timeout" and "body" in error["message"], error
        writer.close()
        server = runner.server
        await wait_for(lambda: server is not None and not server.connections)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # its place, free
        writer.write(post_head("/echo", 2) + b"hi")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_a_body_sent_a_byte_at_a_time_slower_than_the_minimum_rate_is_answered_408() -> None:
    """A body a byte every few seconds (every gap under the body timeout) held a place as
    long as it lasted: 64 of them kept a request port answering 503. Past the body timeout
    a body must come at the minimum rate on average; this one (a byte per 20 ms against
    1,000 bytes/s) is cut long before its 2,000 bytes are sent."""
    limits = {"head_timeout": 60, "body_timeout": 0.5, "body_min_rate": 1000}
    async with serving(max_connections=4, **limits) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post_head("/echo", 2000))
        answer = asyncio.ensure_future(reader.read())  # to the close
        sent = 0
        while sent < 2000 and not answer.done():
            writer.write(b"x")
            sent += 1
            await asyncio.sleep(0.02)  # (the slow client itself, not a synchronisation)
        status, error = openai_error(await asyncio.wait_for(answer, 10))
        assert status == b"HTTP/1.1 408 Request Timeout", (status, sent)
        assert error["code"] == "request_timeout", error
        assert sent < 2000
        writer.close()


async def test_a_body_that_stops_coming_after_the_answer_began_is_closed_with_no_second_answer() -> (
    None
):
    """An answer already begun is not followed by a 408 (it would be read as its end): the
    connection is only closed."""
    async with serving(max_connections=4, head_timeout=60, body_timeout=0.2) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post_head("/answer-then-read", 100) + b"{")
        answer = await asyncio.wait_for(reader.read(), 10)  # to the close
        assert answer.startswith(b"HTTP/1.1 200") and b"begun" in answer, answer
        assert b"408" not in answer and b"request_timeout" not in answer, answer
        writer.close()


async def test_adapter_loads_and_chats_whose_bodies_stop_coming_are_answered_408(
    store_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Both servers of a worker time bodies: the status server's adapter loads (an admin
    route, no handler cancellation there) and an endpoint's request port, with nothing
    logged as an error for the client's slowness."""
    monkeypatch.setattr(http_server, "BODY_TIMEOUT", 0.2, raising=False)
    caplog.set_level(logging.ERROR)
    async with Runtime(store_url) as runtime:
        endpoint = runtime.endpoint("default.backend.generate")
        await endpoint.serve(MockerEngine("mock-model", speedup=0))
        assert endpoint.url is not None
        for url, path in (
            (runtime.status_url, "/v1/loras"),
            (endpoint.url, "/v1/chat/completions"),
        ):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(post_head(path, 100) + b'{"name": ')
            status, error = openai_error(await asyncio.wait_for(reader.read(), 10))
            assert status == b"HTTP/1.1 408 Request Timeout", (path, status)
            assert error["code"] == "request_timeout", (path, error)
            writer.close()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
