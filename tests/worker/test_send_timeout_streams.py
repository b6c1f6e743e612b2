"""The worker servers' send timeout (`shoal.worker.http_server`) against streams whose client
reads steadily, slower than the answer comes."""

from __future__ import annotations

import asyncio

from aiohttp import web

from shoal.worker.http_server import start_server

CHUNK = b"data: " + b"x" * 4090 + b"\n\n"  # (an SSE event of 4 KiB)


async def _stream(request: web.Request) -> web.StreamResponse:
    """Events as fast as the client's connection takes them (a generation faster than its
    reader), for as long as it stays."""
    response = web.StreamResponse()
    await response.prepare(request)
    while True:
        await response.write(CHUNK)


async def test_a_stream_read_steadily_slower_than_it_comes_is_not_cut() -> None:
    """A client reading a stream all the time, slower than it comes (a frontend passing a slow
    client's pace on), was cut by the send timeout (here 0.5 s: 3 runs of 3 cut within 6 s,
    after 7.6-8.2 MB): the write buffer goes between paused (over its high-water mark) and
    resumed, and one paused at a look with more bytes than at the last was taken for a
    client reading nothing; and the write buffer stands still while the socket's own, full,
    drains to half before taking more. Now writing resumed, or the bytes waiting in both
    buffers going down, is the client reading."""
    app = web.Application()
    app.router.add_get("/stream", _stream)
    runner = await start_server(
        app, "127.0.0.1", 0, max_connections=4, access_log=None, send_timeout=0.5
    )
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200"), head
        loop = asyncio.get_running_loop()
        started, got = loop.time(), 0
        while loop.time() - started < 6:  # (12 send timeouts)
            piece = await asyncio.wait_for(reader.read(16384), 10)
            assert piece, f"cut after {got} bytes, {loop.time() - started:.2f} s"
            got += len(piece)
            await asyncio.sleep(0.01)  # (the slow client itself, not a synchronisation)
        writer.close()
    finally:
        await runner.cleanup()
