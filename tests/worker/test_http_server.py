"""The worker's aiohttp servers bound their connections: their number, a head's time, idle."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from shoal.worker.http_server import BoundedRunner, start_server
from tests.helpers import wait_for

GET = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@contextlib.asynccontextmanager
async def serving(**limits: float) -> AsyncIterator[tuple[BoundedRunner, int]]:
    app = web.Application()
    app.router.add_get("/ok", _ok)
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
