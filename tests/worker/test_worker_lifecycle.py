"""A worker process's lifecycle: drain on SIGTERM, vanishing on SIGKILL, surviving a store outage."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shoal.discovery import Discovery
from shoal.discovery.keys import INSTANCES, MODELS
from shoal.store import Store, StoreError, open_store
from shoal.worker.engines.mocker import MockerEngine
from shoal.worker.runtime import Runtime
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


@pytest.mark.parametrize("sig", [signal.SIGHUP], ids=["sighup"])
async def test_a_hangup_drains_like_sigterm_and_leaves_no_key(
    start_worker: StartWorker, store: Store, sig: signal.Signals
) -> None:
    """A closed terminal or a lost ssh session sends SIGHUP: the worker drains and withdraws,
    rather than dying with its cards announced until its lease runs out."""
    worker = await start_worker("--lease-ttl", "60")
    discovery = Discovery(store)
    assert [m.instance_id for m in await discovery.list()] == [worker.instance_id]
    worker.signal(sig)
    assert await worker.wait(15) == 0
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


async def test_a_card_deleted_from_the_store_is_put_back_and_reported(
    start_worker: StartWorker, store: Store
) -> None:
    worker = await start_worker("--lease-ttl", "1.5")
    before = {kv.key: kv.value for kv in (await store.get_prefix("shoal/v1/")).items}
    model_keys = [k for k in before if k.startswith(MODELS)]
    assert len(model_keys) == 1 and any(k.startswith(INSTANCES) for k in before)
    for key in before:
        await store.delete(key)

    async def all_back() -> bool:
        now = {kv.key: kv.value for kv in (await store.get_prefix("shoal/v1/")).items}
        return now.keys() == before.keys()

    await wait_for(all_back, timeout=5, message="the worker put its keys back")
    now = {kv.key: kv.value for kv in (await store.get_prefix("shoal/v1/")).items}
    assert now[model_keys[0]] == before[model_keys[0]]
    assert "missing from the store" in worker.stderr()
    async with aiohttp.ClientSession() as http:
        assert await health(http, worker) == 200
        async with http.get(worker.status_url + "/metrics") as resp:
            assert "shoal_worker_registrations_repaired_total 2.0" in await resp.text()


async def test_a_worker_whose_store_file_was_deleted_registers_in_the_one_made_there(
    start_worker: StartWorker, store_url: str, tmp_path: Path
) -> None:
    """The embedded store's file deleted under a running worker (its state directory wiped):
    the worker wrote on in the deleted file, /health 200, while every process opening the
    path (a frontend, `shoal ls`) saw an empty fleet, for good. Now it re-registers in the
    file at the path, under a new lease."""
    worker = await start_worker("--lease-ttl", "2")
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"store.db{suffix}").unlink(missing_ok=True)

    async def listed_in_the_new_file() -> bool:
        store = await open_store(store_url)
        try:
            models = await Discovery(store).list()
        finally:
            await store.close()
        return [m.card.display_name for m in models] == ["mock-model"]

    await wait_for(listed_in_the_new_file, timeout=15, message="the worker in the new file")
    async with aiohttp.ClientSession() as http:
        assert await health(http, worker) == 200
    assert worker.proc.returncode is None


async def test_health_says_when_a_registration_is_missing_and_cannot_be_put_back(
    store_url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Runtime(store_url) as runtime:
        endpoint = runtime.endpoint("default.backend.generate")
        await endpoint.serve(MockerEngine("mock-model", speedup=0))
        registrations = runtime.registrations
        key = endpoint.models[None].key.key
        await store.delete(key)

        async def refused(*args: Any, **kwargs: Any) -> None:
            raise StoreError("refused")

        monkeypatch.setattr(registrations.store, "put_many", refused)
        await registrations.renew()
        problem = registrations.lease_problem()
        assert problem is not None and "missing" in problem and key in problem
        async with (
            aiohttp.ClientSession() as http,
            http.get(runtime.status_url + "/health") as resp,
        ):
            assert resp.status == 503
            assert any(key in r for r in (await resp.json())["reasons"])
        monkeypatch.undo()
        await registrations.renew()
        assert registrations.lease_problem() is None
        assert await store.get(key) is not None


async def test_checking_that_200_models_are_still_registered_costs_one_store_read(
    store_url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each lease-loop turn checks the worker's keys are still in the store: with many
    models (adapters), one read per key made a turn take a round trip per model while
    holding the registrations' lock, delaying the next keepalive past the TTL on a
    distant store (200 models x 20 ms = 4 s)."""
    async with Runtime(store_url) as runtime:
        endpoint = runtime.endpoint("default.backend.generate")
        await endpoint.serve(MockerEngine("mock-model", speedup=0))
        registrations = runtime.registrations
        card = endpoint.models[None].card
        for i in range(200):
            await registrations.attach(endpoint.id, card, f"adapter-{i}", {})
        reads: list[str] = []
        own = registrations.store
        for name in ("get", "get_prefix", "get_prefixes"):
            method = getattr(own, name)

            async def counted(*args: Any, _method: Any = method, _name: str = name) -> Any:
                reads.append(_name)
                return await _method(*args)

            monkeypatch.setattr(own, name, counted)
        gone = endpoint.models[None].key.key
        await store.delete(gone)
        await store.delete(registrations.models_of(endpoint.id)["adapter-7"].key.key)
        await registrations.renew()
        assert len(reads) == 1, reads
        assert await store.get(gone) is not None
        assert registrations.repairs == 2
        assert registrations.lease_problem() is None
