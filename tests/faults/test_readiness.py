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
from tests.faults.support import RECONCILE_INTERVAL, Load, TcpProxy, routes_exactly, until

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


async def reconciler_held_up(url: str) -> bool:
    """The frontend's reconciler has been held up by the store for more than three intervals:
    its steps kept failing (etcd stopped) or it waited on the store (etcd stalled) that long,
    which used to fail `/ready`."""
    status, body = await get(f"{url}/health/controllers")
    reason = body.get("unhealthy", {}).get("model-reconciler", "")
    return status == 503 and ("steps failing for" in reason or "no progress for" in reason)


async def outage_reported(url: str) -> bool:
    status, body = await get(f"{url}/health/controllers")
    return status == 503 and "unreachable since" in body.get("unhealthy", {}).get("store", "")


async def store_reachable(url: str) -> bool:
    status, body = await get(f"{url}/health")
    return status == 200 and bool(body["store"]["reachable"])


@pytest.mark.parametrize("fault", ["stopped", "stalled"])
async def test_a_store_outage_leaves_every_frontend_ready_and_serving(
    processes: Any, own_etcd: EtcdServer, namespace: str, tmp_path: Path, fault: str
) -> None:
    """etcd stopped (calls refused at once), or its traffic stalled (each call waits for its
    deadline, longer than three reconcile intervals)."""
    proxy = await TcpProxy("127.0.0.1", own_etcd.client_port).start()
    store_url = own_etcd.url if fault == "stopped" else f"etcd://127.0.0.1:{proxy.port}"
    fleet = Fleet(processes, store_url, namespace, tmp_path)
    # The worker reaches etcd directly, under a lease that outlives the outage: only the
    # frontends' store is in trouble.
    direct = Fleet(processes, own_etcd.url, namespace, tmp_path)
    worker = await direct.worker("--lease-ttl", "15")
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
        own_etcd.stop() if fault == "stopped" else proxy.stall()
        # Down long enough for each reconciler to be held up more than three intervals.
        for url in urls:
            await until(lambda u=url: reconciler_held_up(u), 10 + 6 * RECONCILE_INTERVAL, "held up")  # type: ignore[misc]
        assert probe.not_ready == []
        for url in urls:
            await until(lambda u=url: outage_reported(u), 10, "the store's outage reported")  # type: ignore[misc]
            if fault == "stopped":  # (a stalled store's failures come a call deadline apart)
                status, body = await get(f"{url}/health/controllers")
                reason = body["unhealthy"]["model-reconciler"]
                assert reason.startswith("steps failing for"), reason
            status, body = await get(f"{url}/health")
            assert status == 200
            assert body["store"]["reachable"] is False and body["store"]["error"]
            _, metrics = await get(f"{url}/metrics")
            assert "shoal_frontend_store_reachable 0.0" in metrics
        await load.advance(20)  # answered from what each frontend knows
        own_etcd.start() if fault == "stopped" else proxy.heal()
        for url in urls:
            await until(lambda u=url: store_reachable(u), 30, "store reachable again")  # type: ignore[misc]
        await load.advance(10)
    finally:
        await load.finish()
        await probe.stop()
        await proxy.close()
    assert probe.probes > 20
    assert probe.not_ready == []
    assert load.failed_before_first_byte == []
    assert load.failed_mid_stream == []
