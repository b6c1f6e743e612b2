"""End to end: `shoal catalog apply` of a deployment and an alias makes workers run and routes
appear in the store, through `shoal up` and `shoal catalog serve --store` as users run them."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import openai
import pytest

from shoal.catalog import DEPLOYMENTS, PROVIDERS, CatalogClient
from shoal.catalog.leader import leader_key
from shoal.discovery import Discovery, FleetTarget, Query, decode_route, route_key
from shoal.store import Store, open_store
from tests.catalog.test_cli import catalog_cli
from tests.etcd_server import EtcdServer
from tests.helpers import free_port, wait_for
from tests.processes import Processes

FILE = """\
kind: Deployment
name: mock
model: mock-llm
engine: mocker
replicas: 2
namespace: e2e
engine_args: {speedup: 0}
---
kind: VirtualModel
name: chat
default_model: mock-llm
"""


async def routes(store: Store) -> dict[str, tuple[FleetTarget, ...]]:
    found = {}
    for kv in (await store.get_prefix("shoal/v1/routes/default/")).items:
        found[kv.key] = decode_route(kv.key, kv.value).targets
    return found


async def deployment_brings_workers_and_routes(catalog_url: str, store: Store, tmp: Path) -> None:
    """Apply FILE; wait for READY, two workers and both routes; then delete and see them go."""
    (tmp / "fleet.yaml").write_text(FILE)
    code, out, err = await catalog_cli("apply", "-f", str(tmp / "fleet.yaml"), "--url", catalog_url)
    assert code == 0, err
    assert sorted(out.splitlines()) == [
        "deployment default/mock created",
        "virtual-model default/chat created",
    ]
    discovery = Discovery(store)
    wanted = {
        route_key("default", "chat"): (FleetTarget("mock-llm", 1),),
        route_key("default", "mock-llm"): (FleetTarget("mock-llm", 1),),
    }

    async def published() -> bool:
        return await routes(store) == wanted

    await wait_for(published, timeout=120, message="the routes of chat and mock-llm")
    assert len(await discovery.list(Query("e2e"))) == 2
    async with CatalogClient(catalog_url, workspace="default") as client:
        mock = await client.get(DEPLOYMENTS, "mock")
        assert (mock.status, mock.status_message) == ("READY", "2/2 ready")
        assert (await client.get(PROVIDERS, "deployment-mock")).status == "READY"
        await client.update(DEPLOYMENTS, "mock", {"status": "DELETING"})

        async def deleted() -> bool:
            gone = await client.get(DEPLOYMENTS, "mock")
            return gone.status == "DELETED" and not await discovery.list(Query("e2e"))

        await wait_for(deleted, timeout=60, message="deployment DELETED, its workers gone")

        async def unrouted() -> bool:
            return await routes(store) == {route_key("default", "chat"): ()}

        await wait_for(unrouted, timeout=30, message="mock-llm unpublished, chat with no target")
        assert await client.list_all(PROVIDERS) == []


async def test_apply_a_deployment_and_an_alias_to_shoal_up(
    processes: Processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHOAL_CATALOG_DB", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("SHOAL_CONTROLLER_INTERVAL", "0.3")
    monkeypatch.setenv("SHOAL_LEADER_TTL", "2")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    catalog_port = free_port()
    await processes.start(
        "up", "--workers", "0", "--port", str(free_port()), "--catalog-port", str(catalog_port),
        "--store", store_url, ready=re.compile(r"^Press Ctrl-C to stop\.$"), timeout=60,
    )  # fmt: skip
    store = await open_store(store_url)
    try:
        await deployment_brings_workers_and_routes(
            f"http://127.0.0.1:{catalog_port}", store, tmp_path
        )
    finally:
        await store.close()


async def test_two_catalog_replicas_one_leads_and_the_other_takes_over(
    processes: Processes, tmp_path: Path, database_url: str
) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    serve = ["catalog", "serve", "--db", database_url, "--store", store_url]
    interval = ["--controller-interval", "0.3", "--leader-ttl", "2"]
    replicas = [
        await processes.start(*serve, "--port", str(free_port()), *interval, ready="catalog")
        for _ in range(2)
    ]
    store = await open_store(store_url)
    try:
        await wait_for(lambda: store.get(leader_key("models-controller")), timeout=30)
        held = await store.get(leader_key("models-controller"))
        assert held is not None
        leader = next(r for r in replicas if f":{r.proc.pid}:".encode() in held.value)
        leader.signal(15)
        assert await leader.wait(60) == 0
        survivor = next(r for r in replicas if r is not leader)

        async def taken_over() -> bool:
            now = await store.get(leader_key("models-controller"))
            return now is not None and f":{survivor.proc.pid}:".encode() in now.value

        await wait_for(taken_over, timeout=30, message="the other replica leads")
        await deployment_brings_workers_and_routes(survivor.ready["url"], store, tmp_path)
    finally:
        await store.close()


def workers_of(pids: list[int]) -> dict[int, list[int]]:
    """The live (not zombie) `shoal worker` children of each of `pids`, from /proc."""
    found: dict[int, list[int]] = {pid: [] for pid in pids}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) in found and state != "Z" and b"worker" in cmdline:
            found[int(ppid)].append(int(entry.name))
    return found


async def test_a_deposed_leader_stops_its_workers_before_the_new_leader_starts_any(
    processes: Processes, own_etcd: EtcdServer, database_url: str
) -> None:
    """Two replicas; the leader runs the one worker of a `replicas: 1` deployment and is
    paused (SIGSTOP) past its lease TTL, so the other takes over. The paused one stops its
    worker as soon as it runs again (SIGCONT), and the new leader starts its own only one
    TTL after winning: at no moment do two workers run. After DELETING none runs. (On etcd:
    a SQLite store's lock can be held by the paused process.)"""
    ttl = 2.0
    store_url = own_etcd.url
    serve = ["catalog", "serve", "--db", database_url, "--store", store_url,
             "--controller-interval", "0.2", "--leader-ttl", str(ttl)]  # fmt: skip
    first = await processes.start(*serve, "--port", str(free_port()), ready="catalog")
    second = await processes.start(*serve, "--port", str(free_port()), ready="catalog")
    pids = [first.proc.pid, second.proc.pid]
    by_pid = {first.proc.pid: first, second.proc.pid: second}
    most: list[int] = [0]
    samples: list[dict[int, list[int]]] = []

    async def sample() -> None:
        while True:
            found = await asyncio.to_thread(workers_of, pids)
            samples.append(found)
            most[0] = max(most[0], sum(len(w) for w in found.values()))
            await asyncio.sleep(0.02)  # a sampling period, not synchronisation

    sampler = asyncio.create_task(sample())
    async with CatalogClient(first.url, workspace="default") as client:
        try:
            await client.create(DEPLOYMENTS, {"name": "one", "model": "mock-llm",
                                              "engine": "mocker", "replicas": 1,
                                              "namespace": "fence",
                                              "engine_args": {"speedup": 0}})  # fmt: skip

            async def ready() -> bool:
                return (await client.get(DEPLOYMENTS, "one")).status == "READY"

            await wait_for(ready, timeout=60, message="the deployment READY")
            running = await asyncio.to_thread(workers_of, pids)
            leader_pid = next(pid for pid, found in running.items() if found)
            leader, follower = by_pid[leader_pid], by_pid[sum(pids) - leader_pid]
            leader.signal(signal.SIGSTOP)
            store = await open_store(store_url)
            try:

                async def taken_over() -> bool:
                    held = await store.get(leader_key("models-controller"))
                    return held is not None and f":{follower.proc.pid}:".encode() in held.value

                await wait_for(taken_over, timeout=30, message="the follower took over")
            finally:
                await store.close()
            leader.signal(signal.SIGCONT)

            async def handed_over() -> bool:
                found = await asyncio.to_thread(workers_of, pids)
                return not found[leader.proc.pid] and len(found[follower.proc.pid]) == 1

            await wait_for(handed_over, timeout=60, message="the follower's worker alone")
            assert most[0] == 1, [s for s in samples if sum(map(len, s.values())) > 1][:3]
            await client.update(DEPLOYMENTS, "one", {"status": "DELETING"})

            async def none_left() -> bool:
                found = await asyncio.to_thread(workers_of, pids)
                return not any(found.values())

            await wait_for(none_left, timeout=60, message="no worker after DELETING")
        finally:
            sampler.cancel()
            first.signal(signal.SIGCONT)
            second.signal(signal.SIGCONT)
    assert most[0] == 1


async def test_serve_with_a_store_it_cannot_use_says_so_and_exits(tmp_path: Path) -> None:
    code, out, err = await catalog_cli(
        "serve", "--db", f"sqlite:///{tmp_path / 'c.db'}", "--port", str(free_port()),
        "--store", "nope://x",
    )  # fmt: skip
    assert code == 1 and out == ""
    assert "models controller cannot start" in err and "nope" in err


async def test_the_openai_client_gets_answers_through_an_alias_applied_to_shoal_up(
    processes: Processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHOAL_CATALOG_DB", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("SHOAL_CONTROLLER_INTERVAL", "0.3")
    monkeypatch.setenv("SHOAL_LEADER_TTL", "2")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    port, catalog_port = free_port(), free_port()
    await processes.start(
        "up", "--workers", "0", "--port", str(port), "--catalog-port", str(catalog_port),
        "--store", store_url, ready=re.compile(r"^Press Ctrl-C to stop\.$"), timeout=60,
    )  # fmt: skip
    (tmp_path / "fleet.yaml").write_text(FILE)
    code, _, err = await catalog_cli(
        "apply", "-f", str(tmp_path / "fleet.yaml"), "--url", f"http://127.0.0.1:{catalog_port}"
    )
    assert code == 0, err
    store = await open_store(store_url)
    try:
        await wait_for(lambda: routes(store), timeout=120, message="routes published")
    finally:
        await store.close()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)

    async def answered() -> bool:
        reply = await client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        return bool(reply.choices[0].message.content)

    await wait_for(answered, timeout=60, message="an answer through the alias")
    assert "chat" in {m.id for m in (await client.models.list()).data}
    await client.close()
