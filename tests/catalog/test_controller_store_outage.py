"""The models controller through an outage of the discovery store every replica shares (a real
etcd, frozen): its calls to the store are waits on a shared dependency, reported as such,
never a loop stuck on its own work, so no replica's readiness probe fails for it."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp

from shoal.catalog import VIRTUAL_MODELS, CatalogServer
from shoal.catalog.controller import ControllerConfig, ModelsControllerService
from tests.catalog.controller_fixtures import WS, RecordingClient
from tests.etcd_server import EtcdServer
from tests.helpers import wait_for


async def test_a_frozen_store_never_fails_readiness_and_the_controller_recovers(
    catalog: CatalogServer, own_etcd: EtcdServer, tmp_path: Path
) -> None:
    """etcd frozen (SIGSTOP: connections open, no answers) for 8 s under a controller whose
    loop may be silent 1.5 s: each store call waits up to its 5 s deadline. `/ready` stayed
    200 throughout (it answered 503, 'no progress', on every replica at once), and the
    controller leads and passes again once etcd answers."""
    config = ControllerConfig(
        catalog_url=catalog.url, store_url=own_etcd.url, interval=0.5, log_dir=tmp_path,
        leader_ttl=1.0,
    )  # fmt: skip
    service = ModelsControllerService(config)
    await service.start()
    catalog.controllers = service.manager
    assert own_etcd.proc is not None
    try:
        controller = service.controller
        assert controller is not None
        async with RecordingClient(catalog.url, workspace=WS) as client:
            await client.create(VIRTUAL_MODELS, {"name": "chat", "default_model": "m"})
        await wait_for(lambda: controller.passes >= 1, timeout=30)
        not_ready: list[str] = []
        async with aiohttp.ClientSession() as http:

            async def sample(seconds: float) -> None:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    async with http.get(f"{catalog.url}/ready") as resp:
                        if resp.status != 200:
                            not_ready.append(await resp.text())
                    await asyncio.sleep(0.1)  # sampling the probe, as a balancer would

            own_etcd.proc.send_signal(signal.SIGSTOP)
            try:
                await sample(8.0)
            finally:
                own_etcd.proc.send_signal(signal.SIGCONT)
            passes = controller.passes
            await wait_for(lambda: controller.passes > passes, timeout=30)
            await wait_for(lambda: service.manager.unhealthy() == {}, timeout=30)
        assert not_ready == [], not_ready[:3]
    finally:
        catalog.controllers = None
        await service.stop()
