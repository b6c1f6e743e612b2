"""The models controller through an outage of the catalog's database (a real PostgreSQL behind
a TCP relay that stops relaying: connections open, no answers): the API answers again, and
the controller passes again, once the database answers, without a restart."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import sqlalchemy as sa

from shoal.catalog import VIRTUAL_MODELS, CatalogConfig, CatalogServer
from shoal.catalog.controller import ControllerConfig, ModelsControllerService
from shoal.discovery import route_key
from tests.catalog.controller_fixtures import WS, RecordingClient
from tests.helpers import wait_for
from tests.postgres_server import PostgresDatabase


class Relay:
    """A TCP relay to `target`; while `frozen` is clear, bytes pass both ways, while it is
    set they wait (a database that stopped answering, its connections still open)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self.flowing.wait()
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.flowing.wait()
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        for pipe in (self._pipe(reader, up_writer), self._pipe(up_reader, writer)):
            task = asyncio.create_task(pipe)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        self.flowing.set()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.server is not None:
            self.server.close()


@contextlib.asynccontextmanager
async def relayed_catalog(postgres: PostgresDatabase) -> AsyncIterator[tuple[CatalogServer, Relay]]:
    url = sa.make_url(postgres.url)
    relay = Relay(url.host or "127.0.0.1", url.port or 5432)
    port = await relay.start()
    relayed = url.set(port=port).render_as_string(hide_password=False)
    catalog = CatalogServer(CatalogConfig(database_url=relayed, port=0))
    await catalog.start()
    try:
        yield catalog, relay
    finally:
        relay.flowing.set()
        await catalog.stop()
        await relay.close()


async def test_the_controller_and_the_api_recover_from_a_frozen_database_without_a_restart(
    postgres: PostgresDatabase, tmp_path: Path
) -> None:
    """PostgreSQL stops answering for 6 s under a controller whose loop may be silent 1.5 s,
    its API's pooled connections open and stalled: the loop is reported (a catalog call
    waiting on the stalled database reads as its own: `/health/controllers` 503, 'no
    progress'), and once the database answers, the same connections serve again, a new
    virtual model gets its route and every loop is healthy, with nothing restarted."""
    async with (
        relayed_catalog(postgres) as (catalog, relay),
        RecordingClient(catalog.url, workspace=WS) as client,
    ):
        await client.create(VIRTUAL_MODELS, {"name": "chat", "default_model": "m"})
        config = ControllerConfig(
            catalog_url=catalog.url, store_url="memory://", interval=0.5, log_dir=tmp_path,
            leader_ttl=1.0,
        )  # fmt: skip
        service = ModelsControllerService(config)
        await service.start()
        catalog.controllers = service.manager
        try:
            controller = service.controller
            assert controller is not None
            await wait_for(lambda: controller.passes >= 1, timeout=30)
            reports: list[int] = []
            async with aiohttp.ClientSession() as http:
                relay.flowing.clear()
                try:
                    end = time.monotonic() + 6.0
                    while time.monotonic() < end:
                        async with http.get(f"{catalog.url}/health/controllers") as resp:
                            reports.append(resp.status)
                        await asyncio.sleep(0.1)  # sampling the report, as a monitor would
                finally:
                    relay.flowing.set()
            assert 503 in reports  # the outage was seen
            await client.create(VIRTUAL_MODELS, {"name": "after", "default_model": "m"})
            passes = controller.passes
            await wait_for(lambda: controller.passes > passes + 1, timeout=60)
            assert controller.last is not None and controller.last.failed == {}
            assert service.store is not None
            assert await service.store.get(route_key(WS, "after")) is not None
            await wait_for(lambda: service.manager.unhealthy() == {}, timeout=60)
        finally:
            catalog.controllers = None
            await service.stop()
