"""Over HTTPS a connection counts against `--max-connections` from its accept to its close,
its TLS handshake included: counted once the handshake was done, thousands of sockets that
never finish one were bounded only by the handshake's timeout. The one over the limit is
closed at its accept, without a handshake (a 503 cannot be sent before one). On both loops:
`shoal frontend` runs on uvloop, whose TLS layer is its own."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import aiohttp
import pytest

from shoal.frontend.http.listener import HttpServer
from tests.frontend.conftest import StartFrontend
from tests.frontend.test_client_limits import read_until_closed
from tests.helpers import wait_for

pytestmark = pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])

LIVE = b"GET /live HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def counted(server: HttpServer | None) -> int:
    assert server is not None
    return server.open_connections


async def connect(port: int) -> Stream:
    """A TCP connection that starts no handshake (yet)."""
    return await asyncio.open_connection("127.0.0.1", port)


async def test_tls_connections_count_from_their_accept_and_the_one_over_the_limit_is_closed(
    start_frontend: StartFrontend, certificates: dict[str, Path]
) -> None:
    """Three sockets that never start a handshake hold a limit of 3: the fourth is closed at
    once (before: it was let in, and waited out the handshake's timeout, 30 s here), and
    the three still count, open: one of them shakes hands and is served."""
    frontend = await start_frontend(
        tls_certfile=certificates["cert"],
        tls_keyfile=certificates["key"],
        max_connections=3,
        header_timeout=30,
    )
    held = [await connect(frontend.port) for _ in range(3)]
    try:
        reader, writer = await connect(frontend.port)
        try:
            assert await read_until_closed(reader, timeout=5.0) == b""  # (no handshake)
        finally:
            writer.close()
        assert counted(frontend.server) == 3
        reader, writer = held[0]
        context = ssl.create_default_context(cafile=str(certificates["ca"]))
        await writer.start_tls(context, server_hostname="127.0.0.1")
        writer.write(LIVE)
        assert (await read_until_closed(reader)).startswith(b"HTTP/1.1 200 ")
    finally:
        for _, w in held:
            w.close()
    await wait_for(lambda: counted(frontend.server) == 0, message="every connection released")


async def test_tls_handshakes_that_time_out_fail_or_are_left_give_their_place_back(
    start_frontend: StartFrontend, certificates: dict[str, Path]
) -> None:
    """No handshake's end leaks its place: timed out, failed (plain HTTP on the TLS port),
    left by the client midway. Then as many real TLS clients as the limit are served at
    once, each keeping its connection."""
    frontend = await start_frontend(
        tls_certfile=certificates["cert"],
        tls_keyfile=certificates["key"],
        max_connections=2,
        header_timeout=1.0,
    )
    idle = [await connect(frontend.port) for _ in range(2)]
    over = await connect(frontend.port)
    try:
        assert await read_until_closed(over[0], timeout=0.4) == b""  # (the limit: at once)
        for reader, _ in idle:  # (their handshake's timeout: `--header-timeout`)
            assert await read_until_closed(reader, timeout=10.0) == b""
    finally:
        for _, w in [*idle, over]:
            w.close()
    await wait_for(lambda: counted(frontend.server) == 0, message="timed out: released")
    reader, writer = await connect(frontend.port)
    writer.write(LIVE)  # (plain HTTP to the TLS port: the handshake fails)
    try:
        assert not (await read_until_closed(reader)).startswith(b"HTTP/1.1 ")
    finally:
        writer.close()
    reader, writer = await connect(frontend.port)
    writer.write(b"\x16\x03\x01")  # (half a record of a ClientHello, then gone)
    writer.close()
    await wait_for(lambda: counted(frontend.server) == 0, message="failed and left: released")
    context = ssl.create_default_context(cafile=str(certificates["ca"]))
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as first,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as second,
    ):
        for _ in range(2):
            for session in (first, second):
                async with session.get(f"{frontend.url}/live") as response:
                    assert response.status == 200
                    await response.read()
            assert counted(frontend.server) == 2  # (both kept alive: two at once, the limit)
