"""Readiness under a store outage: every frontend stays ready and serving while etcd is down
long enough for the reconciler to fail several intervals, and the outage shows in `/health`,
`/health/controllers` and `/metrics` instead (real `shoal` processes, a real etcd)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.etcd_server import EtcdServer
from tests.faults.conftest import Fleet
from tests.faults.support import RECONCILE_INTERVAL, Load, routes_exactly, until

pytestmark = pytest.mark.etcd


class ReadyProbe:
    """Polls `/ready` of each frontend, as a Kubernetes readiness probe would (faster), and
    keeps every answer that was not 200."""

    def __init__(self, urls: list[str], period: float = 0.05) -> None:
        self.urls = urls
        self.period = period
        self.probes = 0
        self.not_ready: list[tuple[str, int, Any]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                for url in self.urls:
                    async with session.get(f"{url}/ready") as response:
                        self.probes += 1
                        if response.status != 200:
                            self.not_ready.append((url, response.status, await response.json()))
                await asyncio.sleep(self.period)  # the probe's period, not a synchronisation

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


async def reconciler_failing(url: str) -> bool:
    """The frontend's reconciler has failed for longer than three intervals (its loop says so
    once its steps kept failing past `max_silence`)."""
    status, body = await get(f"{url}/health/controllers")
    unhealthy = body.get("unhealthy", {})
    return status == 503 and "steps failing for" in unhealthy.get("model-reconciler", "")


async def store_reachable(url: str) -> bool:
    status, body = await get(f"{url}/health")
    return status == 200 and bool(body["store"]["reachable"])


async def test_a_store_outage_leaves_every_frontend_ready_and_serving(
    processes: Any, own_etcd: EtcdServer, namespace: str, tmp_path: Path
) -> None:
    fleet = Fleet(processes, own_etcd.url, namespace, tmp_path)
    worker = await fleet.worker("--lease-ttl", "10")  # the lease outlives the outage
    fronts = [await fleet.frontend("--cache-dir", str(tmp_path / f"cache-{i}")) for i in range(2)]
    urls = [front.url for front in fronts]
    for url in urls:
        await until(lambda u=url: routes_exactly(u, {worker.instance_id}), 15, "worker routed")  # type: ignore[misc]
    probe = ReadyProbe(urls)
    load = Load(urls)
    probe.start()
    load.start()
    try:
        await load.advance(20)
        own_etcd.stop()
        # Down long enough for each reconciler to fail more than three intervals in a row.
        for url in urls:
            await until(lambda u=url: reconciler_failing(u), 10 + 6 * RECONCILE_INTERVAL, "failing")  # type: ignore[misc]
        assert probe.not_ready == []
        for url in urls:
            status, body = await get(f"{url}/health/controllers")
            assert "unreachable since" in body["unhealthy"]["store"]
            status, body = await get(f"{url}/health")
            assert status == 200
            assert body["store"]["reachable"] is False and body["store"]["error"]
            _, metrics = await get(f"{url}/metrics")
            assert "shoal_frontend_store_reachable 0.0" in metrics
        await load.advance(20)  # answered from what each frontend knows
        own_etcd.start()
        for url in urls:
            await until(lambda u=url: store_reachable(u), 30, "store reachable again")  # type: ignore[misc]
        await load.advance(10)
    finally:
        await load.finish()
        await probe.stop()
    assert probe.probes > 20
    assert probe.not_ready == []
    assert load.failed_before_first_byte == []
    assert load.failed_mid_stream == []
