"""A worker on a real etcd: listed, and re-registered without a restart after etcd was down."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from shoal.discovery import Discovery
from shoal.store import open_store
from tests.etcd_server import EtcdServer
from tests.helpers import wait_for
from tests.processes import Process
from tests.worker.conftest import StartWorker

pytestmark = pytest.mark.etcd


async def test_etcd_outage_past_the_ttl_is_survived_and_the_worker_re_registers(
    start_worker: StartWorker, own_etcd: EtcdServer
) -> None:
    ttl = 2.0
    worker = await start_worker(
        "--lease-ttl", str(ttl), "--ttft-ms", "0", "--itl-ms", "30", store=own_etcd.url
    )
    async with aiohttp.ClientSession() as http:
        store = await open_store(own_etcd.url)
        try:
            models = await Discovery(store).list()
            assert [m.instance_id for m in models] == [worker.instance_id]
        finally:
            await store.close()
        body = {
            "model": "mock-model",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 150,
            "stream": True,
        }
        resp = await http.post(worker.url + "/v1/chat/completions", json=body)
        await resp.content.readuntil(b"\n\n")

        own_etcd.stop()
        try:
            await wait_for(lambda: _health(http, worker, 503), timeout=ttl + 5, message="503")
        finally:
            own_etcd.start()

        store = await open_store(own_etcd.url)
        try:
            await wait_for(
                lambda: _listed_once_under_a_new_id(Discovery(store), worker.instance_id),
                timeout=ttl * 3 + 5,
                message="one registration, under a new lease",
            )
        finally:
            await store.close()
        assert worker.proc.returncode is None
        await wait_for(lambda: _health(http, worker, 200), timeout=5, message="healthy again")
        rest = (await resp.read()).decode()
    assert rest.endswith("data: [DONE]\n\n") and rest.count('"content"') == 150


async def _health(http: aiohttp.ClientSession, worker: Process, status: int) -> bool:
    async with http.get(worker.status_url + "/health") as resp:
        return resp.status == status


async def _listed_once_under_a_new_id(discovery: Discovery, old_id: int) -> Any:
    models = await asyncio.wait_for(discovery.list(), 2)
    return len(models) == 1 and models[0].instance_id != old_id
