"""The relay's status server bounds what a client can hold, as a worker's does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from shoal.membership import MembershipStatus
from shoal.relay import KvRelay, RelayConfig, StatusServer
from shoal.worker import http_server
from shoal.worker.http_server import STATUS_MAX_CONNECTIONS
from tests.helpers import refused_past, wait_for


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection (what it sent before is skipped)."""
    return await reader.read(65536) == b"" or await closed(reader)


async def test_the_relays_status_server_refuses_connections_past_its_bound_and_times_silent_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay's status server was aiohttp's plain runner: any number of connections, and
    one that never sent a byte held for good (200 silent ones were all still open after
    20 s), so a client could use up the relay's file descriptors, which its ZMQ sockets to
    the workers and its NATS connection need. Now it holds the worker status server's 128
    (a connection past them is answered 503 `too_many_connections` and closed), a silent
    one is closed after the head timeout, and `/live` answers once they go."""
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT", 1.0)
    relay = KvRelay(RelayConfig(nats_urls=("nats://127.0.0.1:1",)))
    status = StatusServer(relay, SimpleNamespace(status=MembershipStatus()))  # type: ignore[arg-type]
    await status.start("127.0.0.1", 0)
    assert status.url is not None
    host, port = status.url.removeprefix("http://").rsplit(":", 1)
    held = await refused_past(host, int(port), STATUS_MAX_CONNECTIONS)
    try:
        for held_reader, _ in held:
            assert await asyncio.wait_for(closed(held_reader), 10)

        async def live() -> bool:
            async with aiohttp.ClientSession() as http, http.get(status.url + "/live") as r:
                return r.status == 200

        await wait_for(live, message="/live never answered once the silent connections went")
    finally:
        for _, held_writer in held:
            held_writer.close()
        await status.stop()
