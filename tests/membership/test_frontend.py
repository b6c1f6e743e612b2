"""The frontend's scope follows the membership view: namespaces join and leave without a
restart, the view and status are served, and a membership error shows in the health."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from shoal.cli.frontend import start_frontend
from shoal.cli.scope import membership_for
from shoal.discovery import Added, Discovery
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.registry.scope import FOLLOW_SLICE
from shoal.membership import MembershipWatch, Selection, parse_sources
from shoal.store import Store, open_store
from tests.etcd_server import EtcdServer
from tests.frontend.support import FakeWorker, FilteringDiscovery, serving
from tests.helpers import wait_for
from tests.membership.support import DrivenSource, add_endpoint


def write_sources(path: Path, *names: str) -> str:
    """Replace the sources file atomically; returns the revision it holds."""
    data = json.dumps({"version": 1, "sources": [{"namespace": n} for n in names]}).encode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return parse_sources(data).revision


@pytest.fixture
async def store() -> AsyncIterator[Store]:
    s = await open_store(f"memory://{uuid.uuid4().hex}")
    yield s
    await s.close()


@pytest.fixture
async def workers(store: Store) -> AsyncIterator[dict[str, FakeWorker]]:
    started = {}
    for ns in ("team-a", "team-b"):
        worker = await FakeWorker(f"model-{ns}", namespace=ns).start()
        await worker.register(store)
        started[ns] = worker
    yield started
    for worker in started.values():
        await worker.stop()


async def get(url: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def test_namespaces_join_and_leave_the_frontend_scope_as_the_sources_file_changes(
    store: Store, workers: dict[str, FakeWorker], tmp_path: Path
) -> None:
    path = tmp_path / "sources.json"
    write_sources(path, "team-a")
    config = FrontendConfig(port=0, cache_dir=tmp_path / "cache", namespace_sources=path)
    frontend = Frontend(config, discovery=Discovery(store), membership=membership_for(config))
    await frontend.start()
    try:
        await wait_for(lambda: serving(frontend, "model-team-a"))
        assert "model-team-b" not in frontend.registry.models
        status, view = await get(f"{frontend.url}/v1/membership")
        assert status == 200 and view["namespaces"] == ["team-a"]

        revision = write_sources(path, "team-b")
        await wait_for(lambda: serving(frontend, "model-team-b"), timeout=5)
        await wait_for(lambda: "model-team-a" not in frontend.registry.models)
        status, body = await get(f"{frontend.url}/v1/membership/status")
        assert body == {
            "desired_revision": revision,
            "applied_revision": revision,
            "count": 1,
            "last_error": None,
        }

        path.write_text('{"version": 1, "sources": [{"namespace": "team-b", "x": 1}]}')
        await wait_for(lambda: frontend.membership and frontend.membership.status.last_error)
        status, health = await get(f"{frontend.url}/health/controllers")
        assert status == 503
        assert "unknown field `x`" in str(health["unhealthy"]["membership"])  # type: ignore[index]
        assert serving(frontend, "model-team-b")  # the last valid selection stays in force
    finally:
        await frontend.stop()


async def test_membership_routes_are_unknown_on_a_frontend_with_fixed_namespaces(
    store: Store, tmp_path: Path
) -> None:
    frontend = Frontend(
        FrontendConfig(port=0, cache_dir=tmp_path / "cache"), discovery=Discovery(store)
    )
    await frontend.start()
    try:
        status, body = await get(f"{frontend.url}/v1/membership")
        assert status == 404 and body["error"]["code"] == "unknown_url"  # type: ignore[index]
    finally:
        await frontend.stop()


async def test_a_listing_from_before_a_namespace_left_never_registers_its_models(
    store: Store, workers: dict[str, FakeWorker], tmp_path: Path
) -> None:
    discovery = FilteringDiscovery(store)
    discovery.drop = lambda event: isinstance(event, Added)  # only reconciliation registers
    source = DrivenSource()
    source.push(Selection.of(["team-a"]))
    frontend = Frontend(
        FrontendConfig(port=0, cache_dir=tmp_path / "cache", reconcile_interval=3600),
        discovery=discovery,
        membership=lambda d: MembershipWatch(d, source),
    )
    await frontend.start()
    try:
        watcher = frontend.watcher
        assert watcher is not None and not watcher.registrations
        discovery.hold_listings = asyncio.Event()
        calls = discovery.list_calls
        repair = asyncio.create_task(watcher.reconcile())
        await wait_for(lambda: discovery.list_calls > calls)  # the pass has listed team-a
        empty = Selection.of([])
        source.push(empty)
        membership = frontend.membership
        assert membership is not None
        await wait_for(lambda: membership.status.to_dict()["applied_revision"] == empty.revision)
        discovery.hold_listings.set()  # the stale listing comes back after team-a left
        await repair
        assert not watcher.registrations
        assert "model-team-a" not in frontend.registry.models
    finally:
        await frontend.stop()


@pytest.mark.etcd
async def test_a_new_selection_is_made_before_the_old_one_breaks_while_etcd_is_down(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    store = await open_store(own_etcd.url)
    alpha, beta = (
        FakeWorker("model-alpha", namespace="alpha"),
        FakeWorker("model-beta", namespace="beta"),
    )
    for worker in (alpha, beta):
        await worker.start()
        await worker.register(store, ttl=60)
    path = tmp_path / "sources.json"
    before = write_sources(path, "alpha")
    config = FrontendConfig(port=0, cache_dir=tmp_path / "cache", namespace_sources=path)
    frontend = Frontend(config, discovery=Discovery(store), membership=membership_for(config))
    await frontend.start()
    try:
        membership = frontend.membership
        assert membership is not None
        await wait_for(lambda: serving(frontend, "model-alpha"))

        own_etcd.stop()  # the store is briefly unavailable while the file changes
        after = write_sources(path, "beta")
        await wait_for(lambda: membership.status.to_dict()["desired_revision"] == after)
        await wait_for(lambda: membership.status.last_error, timeout=15)
        # The old selection stays in force, and the status and view say so.
        assert membership.status.to_dict()["applied_revision"] == before
        view = membership.view.to_dict()
        assert view["namespaces"] == ["alpha"] and view["revision"] == before
        assert [ep["models"][0]["name"] for ep in view["endpoints"]] == ["model-alpha"]
        assert serving(frontend, "model-alpha")
        async with aiohttp.ClientSession() as session:
            body = {"model": "model-alpha", "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(f"{frontend.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200

        own_etcd.start()  # the store is back: beta is made, then alpha broken
        await wait_for(lambda: serving(frontend, "model-beta"), timeout=20)
        await wait_for(lambda: "model-alpha" not in frontend.registry.models)
        assert membership.status.to_dict() == {
            "desired_revision": after,
            "applied_revision": after,
            "count": 1,
            "last_error": None,
        }
    finally:
        await frontend.stop()
        for worker in (alpha, beta):
            await worker.stop()
        await store.close()


@pytest.mark.etcd
async def test_4096_namespaces_are_set_up_on_etcd_within_the_setup_timeout(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    store = await open_store(etcd_server.url)
    tag = uuid.uuid4().hex[:8]  # the shared etcd: namespaces of this test's own
    names = [f"{tag}-{i}" for i in range(4096)]
    worker = await FakeWorker("model-many", namespace=names[-1]).start()
    await worker.register(store, ttl=60)
    path = tmp_path / "sources.json"
    write_sources(path, *names)
    config = FrontendConfig(
        port=0, cache_dir=tmp_path / "cache", namespace_sources=path, setup_timeout=60
    )
    frontend = Frontend(config, discovery=Discovery(store), membership=membership_for(config))
    try:
        # 10-20 s here: more than the 10 s the membership was once given whatever the flag.
        await frontend.start()
        membership = frontend.membership
        assert membership is not None and membership.status.to_dict()["count"] == 4096
        view = membership.view.to_dict()
        assert len(view["namespaces"]) == 4096
        assert [ep["models"][0]["name"] for ep in view["endpoints"]] == ["model-many"]
        status, _ = await get(f"{frontend.url}/ready")
        assert status == 200
    finally:
        await frontend.stop()
        await worker.stop()
        await store.close()


async def test_ready_is_not_200_before_the_first_selection_is_in_force(
    store: Store, workers: dict[str, FakeWorker], tmp_path: Path
) -> None:
    source = DrivenSource()  # offers no selection yet
    frontend = Frontend(
        FrontendConfig(port=0, cache_dir=tmp_path / "cache"),
        discovery=Discovery(store),
        membership=lambda d: MembershipWatch(d, source, setup_timeout=30),
    )
    starting = asyncio.create_task(frontend.start())
    try:
        await wait_for(lambda: frontend.url, message="the server listens during set-up")
        status, body = await get(f"{frontend.url}/ready")
        assert status == 503, body
        assert "no namespace selection is in force" in str(body["reasons"])
        source.push(Selection.of(["team-a"]))
        await starting
        status, body = await get(f"{frontend.url}/ready")
        assert status == 200, body
    finally:
        if not starting.done():
            starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await frontend.stop()


async def test_a_bad_sources_file_at_start_is_reported_naming_the_file_and_its_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sources.json"
    path.write_text('{"version": 2, "sources": []}')
    config = FrontendConfig(
        store_url=f"sqlite:///{tmp_path / 'store.db'}",
        port=0,
        cache_dir=tmp_path / "cache",
        namespace_sources=path,
        setup_timeout=1,
    )
    assert await start_frontend(config, "shoal frontend") is None
    error = capsys.readouterr().err
    assert f"sources file {path}: version must be 1, got 2" in error, error
    assert "did not answer" not in error


async def test_listings_of_namespaces_that_left_are_dropped(
    store: Store, workers: dict[str, FakeWorker], tmp_path: Path
) -> None:
    discovery = Discovery(store)
    source = DrivenSource()
    source.push(Selection.of(["team-a", "team-b"]))
    frontend = Frontend(
        FrontendConfig(port=0, cache_dir=tmp_path / "cache", reconcile_interval=3600),
        discovery=discovery,
        membership=lambda d: MembershipWatch(d, source),
    )
    await frontend.start()
    try:
        watcher, membership = frontend.watcher, frontend.membership
        assert watcher is not None and membership is not None
        await watcher.reconcile()  # the frontend lists its namespaces too

        def listed() -> set[str | None]:
            return {query.namespace for query in discovery._listed}

        assert listed() == {"team-a", "team-b"}
        kept = Selection.of(["team-b"])
        source.push(kept)
        await wait_for(lambda: membership.status.to_dict()["applied_revision"] == kept.revision)
        await wait_for(lambda: listed() == {"team-b"})
    finally:
        await frontend.stop()


async def test_a_large_selection_swap_is_made_before_broken_a_slice_per_turn_of_the_loop(
    store: Store, tmp_path: Path
) -> None:
    """Swapping N namespaces for N others ran in one callback, each leaving namespace
    rebuilding the query list and scanning every registration: 4,096 for 4,096 held the loop
    2-3 s. Now the new namespaces all join before any old one leaves, and at most
    `FOLLOW_SLICE` namespaces move between two turns of the event loop."""
    n = FOLLOW_SLICE * 2 + 10
    discovery = Discovery(store)
    for i in range(0, n, 50):  # registrations to drop, and to make
        await add_endpoint(discovery, f"a{i}", i + 1)
        await add_endpoint(discovery, f"b{i}", n + i + 1)
    source = DrivenSource()
    source.push(Selection.of([f"a{i}" for i in range(n)]))
    frontend = Frontend(
        FrontendConfig(port=0, cache_dir=tmp_path / "cache"),
        discovery=discovery,
        membership=lambda d: MembershipWatch(d, source),
    )
    await frontend.start()
    watcher = frontend.watcher
    assert watcher is not None
    sizes: list[int] = []

    async def sample() -> None:
        while True:
            sizes.append(len(watcher.queries))
            await asyncio.sleep(0)

    sampler = asyncio.create_task(sample())
    try:
        assert {k.endpoint.namespace for k in watcher.registrations} == {
            f"a{i}" for i in range(0, n, 50)
        }
        source.push(Selection.of([f"b{i}" for i in range(n)]))
        await wait_for(lambda: sizes[-1] == n and max(sizes) == 2 * n, timeout=20)
        await wait_for(
            lambda: (
                {k.endpoint.namespace for k in watcher.registrations}
                == {f"b{i}" for i in range(0, n, 50)}
            )
        )
        assert max(abs(b - a) for a, b in itertools.pairwise(sizes)) <= FOLLOW_SLICE
        assert {q.namespace for q in watcher.queries} == {f"b{i}" for i in range(n)}
    finally:
        sampler.cancel()
        await frontend.stop()


async def test_start_returns_and_ready_says_200_only_once_every_namespace_is_listed(
    tmp_path: Path,
) -> None:
    """The watcher started with no query; the first selection's namespaces were listed by
    their streams after `start()` returned: /ready said 200 (and the ready line was printed)
    with 32 of 500 namespaces' models registered. Now `start()` returns once each namespace's
    first listing is applied."""
    store = await open_store(f"sqlite:///{tmp_path / 'store.db'}")
    names = [f"ns{i:03d}" for i in range(200)]
    try:
        discovery = Discovery(store)
        for i, name in enumerate(names):
            await add_endpoint(discovery, name, i + 1)
        source = DrivenSource()
        source.push(Selection.of(names))
        frontend = Frontend(
            FrontendConfig(port=0, cache_dir=tmp_path / "cache"),
            discovery=discovery,
            membership=lambda d: MembershipWatch(d, source),
        )
        await frontend.start()
        try:
            watcher = frontend.watcher
            assert watcher is not None and watcher.loading() == 0
            assert {k.endpoint.namespace for k in watcher.registrations} == set(names)
            status, body = await get(f"{frontend.url}/ready")
            assert status == 200, body
        finally:
            await frontend.stop()
    finally:
        await store.close()
