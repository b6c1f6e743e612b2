"""The controller's liveness follows progress: a long pass that advances is healthy, a pass
stuck on one call is reported on `/health/controllers` within three intervals."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from shoal.catalog import PROVIDERS, CatalogConfig, CatalogServer, providers
from shoal.controllers import ControllerManager, Loop
from tests.catalog.controller_fixtures import controller_on, openai_servers, seed_converged
from tests.helpers import wait_for


async def test_a_long_pass_with_400_items_and_slow_providers_stays_healthy(
    catalog: CatalogServer, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(providers, "LISTINGS_AT_ONCE", 1)  # one after another: a long pass
    served = {f"p{i}": [f"p{i}-model-{j:03d}" for j in range(100)] for i in range(4)}
    await seed_converged(database_url, served)
    async with (
        openai_servers(*served.values()) as servers,
        controller_on(catalog.url) as (ctl, client, _),
    ):
        for i, server in enumerate(servers):
            server.delay = 0.6  # each provider answers in 40% of max_silence
            await client.update(PROVIDERS, f"p{i}", {"base_url": server.base_url})
        loop = Loop(ctl, interval=0.5, name="models-controller")
        await loop.start()
        unhealthy: list[str] = []
        try:
            while ctl.passes == 0:
                health = loop.health()
                if not health.healthy:
                    unhealthy.append(health.reason or "")
                await asyncio.sleep(0.02)  # sampling the probe, as a readiness check would
                assert loop.running
        finally:
            await loop.stop()
        assert ctl.last is not None
        assert ctl.last.seconds > loop.max_silence  # longer than the silence allowed...
        assert unhealthy == []  # ...and healthy throughout: it beat per item and per call
        assert ctl.last.routes_written == 400


async def test_a_pass_stuck_on_one_call_is_reported_within_three_intervals(
    catalog: CatalogServer,
) -> None:
    async with controller_on(catalog.url) as (ctl, client, _):
        await client.create(PROVIDERS, {"name": "p", "type": "fleet"})
        client.hold = lambda call: call.endswith("/providers")  # that call never answers
        interval = 0.2
        loop = Loop(ctl, interval=interval, name="models-controller")
        manager = ControllerManager([loop])
        catalog.controllers = manager
        await manager.start_all()
        try:
            await wait_for(client.held.is_set, timeout=30)
            stuck_at = time.monotonic()
            await wait_for(lambda: not loop.health().healthy, timeout=3 * interval + 1.0)
            assert time.monotonic() - stuck_at <= 3 * interval + 0.5
            assert "no progress" in (loop.health().reason or "")
            url = f"{catalog.url}/health/controllers"
            async with aiohttp.ClientSession() as http, http.get(url) as resp:
                body = await resp.json()
            assert resp.status == 503
            assert "no progress" in body["unhealthy"]["models-controller"]
            async with aiohttp.ClientSession() as http, http.get(f"{catalog.url}/ready") as resp:
                ready = await resp.json()
            assert resp.status == 503  # stuck on its own call: this replica only
            assert "no progress" in ready["reasons"]["models-controller"]
        finally:
            await manager.stop_all(timeout=0.5)
            catalog.controllers = None


class _Failing:
    """A controller whose steps fail quoting a store address with a password in it."""

    is_healthy = True

    def step(self) -> None:
        raise ConnectionError("redis://:hunter2@10.0.0.5:6379 refused")


async def test_the_controllers_report_quotes_errors_only_to_admin_token_holders(
    database_url: str,
) -> None:
    """`/health/controllers` quotes the loops' errors (workspaces, hosts, store addresses):
    with an admin token, a caller without it gets the status and the loops' names only."""
    server = CatalogServer(CatalogConfig(database_url=database_url, port=0, admin_token="s3"))
    await server.start()
    server.controllers = manager = ControllerManager()
    loop = manager.register(Loop(_Failing(), interval=0.05, max_silence=0.2, name="models"))
    await manager.start_all()
    url = server.url + "/health/controllers"
    try:
        await wait_for(lambda: not loop.health().healthy, timeout=5)
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as resp:
                anonymous = resp.status, await resp.json()
            async with session.get(url, headers={"Authorization": "Bearer s3"}) as resp:
                admin = resp.status, await resp.json()
        assert anonymous == (503, {**anonymous[1], "unhealthy": {"models": "unhealthy"}})
        assert "hunter2" not in json.dumps(anonymous[1])
        assert admin[0] == 503 and "hunter2" in admin[1]["unhealthy"]["models"]
    finally:
        await manager.stop_all()
        await server.stop()
