"""A worker process's lifecycle: drain on SIGTERM, vanishing on SIGKILL, surviving a store outage."""

from __future__ import annotations

import signal
import sqlite3
import time
from typing import Any

import aiohttp

from shoal.discovery import Discovery
from shoal.store import Store
from tests.helpers import wait_for
from tests.processes import Process
from tests.worker.conftest import StartWorker


def chat(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "mock-model",
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def health(http: aiohttp.ClientSession, worker: Process) -> int:
    async with http.get(worker.status_url + "/health") as resp:
        return resp.status


async def test_sigterm_lets_an_in_flight_stream_finish_then_withdraws_and_exits_0(
    start_worker: StartWorker, store: Store
) -> None:
    worker = await start_worker("--ttft-ms", "0", "--itl-ms", "20", "--drain-timeout", "20")
    discovery = Discovery(store)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(worker.url + "/v1/chat/completions", json=chat(60))
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")

        worker.signal(signal.SIGTERM)
        await wait_for(
            lambda: _all_tainted(discovery), timeout=5, message="the model tainted draining"
        )
        rest = (await resp.read()).decode()

    assert rest.endswith("data: [DONE]\n\n")
    assert rest.count('"content"') == 60, "every token of the stream arrived"
    assert await worker.wait(15) == 0
    assert await discovery.list() == []
    assert (await store.get_prefix("shoal/v1/")).items == []


async def _all_tainted(discovery: Discovery) -> bool:
    models = await discovery.list()
    return bool(models) and all("draining" in m.card.taints for m in models)


async def test_sigkilled_worker_disappears_from_discovery_within_the_lease_ttl(
    start_worker: StartWorker, store: Store
) -> None:
    ttl = 1.0
    worker = await start_worker("--lease-ttl", str(ttl))
    discovery = Discovery(store)
    assert [m.instance_id for m in await discovery.list()] == [worker.instance_id]

    killed_at = time.monotonic()
    worker.signal(signal.SIGKILL)
    await wait_for(lambda: _none_listed(discovery), timeout=ttl + 3, message="keys expired")
    assert time.monotonic() - killed_at < ttl + 1.5
    assert (await store.get_prefix("shoal/v1/")).items == []


async def _none_listed(discovery: Discovery) -> bool:
    return not await discovery.list()


async def test_store_outage_past_the_ttl_keeps_serving_reports_503_and_re_registers(
    start_worker: StartWorker, store: Store, store_url: str
) -> None:
    worker = await start_worker("--lease-ttl", "1", "--ttft-ms", "0", "--itl-ms", "25")
    discovery = Discovery(store)
    path = store_url.removeprefix("sqlite://")
    async with aiohttp.ClientSession() as http:
        resp = await http.post(worker.url + "/v1/chat/completions", json=chat(120))
        await resp.content.readuntil(b"\n\n")

        # The outage: another process holds the write lock, so the worker cannot renew.
        lock = sqlite3.connect(path, timeout=10, isolation_level=None)
        try:
            lock.execute("BEGIN EXCLUSIVE")
            await wait_for(lambda: _status_is(http, worker, 503), timeout=5, message="503")
            async with http.get(worker.status_url + "/health") as h:
                reasons = (await h.json())["reasons"]
            assert any("lease" in r for r in reasons), reasons
            async with http.post(
                worker.url + "/v1/chat/completions", json=chat(3, stream=False)
            ) as during:
                assert during.status == 200, "new requests are served during the outage"
        finally:
            lock.execute("ROLLBACK")
            lock.close()

        models = await wait_for(
            lambda: _listed_under_new_id(discovery, worker.instance_id),
            timeout=10,
            message="re-registered under a new lease",
        )
        assert worker.proc.returncode is None, "no restart"
        await wait_for(lambda: _status_is(http, worker, 200), timeout=5, message="healthy again")
        for meta in models[0].card.metadata_files.values():
            async with http.get(meta.url) as got:
                assert got.status == 200
        rest = (await resp.read()).decode()
    assert rest.endswith("data: [DONE]\n\n") and rest.count('"content"') == 120


async def _status_is(http: aiohttp.ClientSession, worker: Process, status: int) -> bool:
    return await health(http, worker) == status


async def _listed_under_new_id(discovery: Discovery, old_id: int) -> list[Any] | None:
    models = await discovery.list()
    if len(models) == 1 and models[0].instance_id != old_id:
        return models
    return None
