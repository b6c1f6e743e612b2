"""Route resolution and publishing at scale: linear in the routes, and yielding to the event
loop (beating the controller's heartbeat) every `SLICE` routes; asserted by counts, never
by timing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from shoal.catalog.resources import Model, Provider, ServedModel, VirtualModel
from shoal.catalog.routing import SLICE, publish, resolve
from shoal.discovery import Route, UrlTarget
from shoal.store import open_store

NOW = datetime.now(UTC).isoformat()
META: dict[str, Any] = {"workspace": "w", "version": 1, "created_at": NOW, "updated_at": NOW}


class CountingList(list[ServedModel]):
    """A provider's `served_models` that counts how often it is scanned."""

    scans = 0

    def __iter__(self) -> Iterator[ServedModel]:
        CountingList.scans += 1
        return super().__iter__()


def fleet_of(n: int) -> tuple[list[VirtualModel], dict[str, Model], dict[str, Provider]]:
    """One url provider serving `n` models, each with its passthrough virtual model."""
    names = [f"m{i}" for i in range(n)]
    served = [{"model_entity": m, "served_model_name": f"served-{m}"} for m in names]
    provider = Provider.model_validate(
        {"name": "p", "type": "url", "base_url": "http://x/v1", "served_models": served, **META}
    )
    entities = {m: Model.model_validate({"name": m, "providers": ["w/p"], **META}) for m in names}
    vms = [VirtualModel.model_validate({"name": m, "default_model": m, **META}) for m in names]
    return vms, entities, {"w/p": provider}


@asynccontextmanager
async def ticker() -> AsyncIterator[list[int]]:
    """A task counting its turns on the event loop: ticks[0] grows only while others yield."""
    ticks = [0]

    async def run() -> None:
        while True:
            ticks[0] += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(run())
    await asyncio.sleep(0)
    try:
        yield ticks
    finally:
        task.cancel()


async def test_resolve_reads_each_providers_served_models_once() -> None:
    """Each provider's served names are looked up in a map made once, not scanned per
    (virtual model, provider): resolution is linear (10,000 models were 3.5 s)."""
    vms, entities, providers = fleet_of(2000)
    provider = providers["w/p"]
    provider.__dict__["served_models"] = CountingList(provider.served_models or [])
    CountingList.scans = 0
    routes = await resolve("w", vms, entities.get, providers)
    assert CountingList.scans == 1
    assert len(routes) == 2000
    assert routes[1234].targets == (UrlTarget("http://x/v1", "served-m1234", 1, None, "w/p"),)


async def test_resolve_and_publish_yield_and_beat_every_slice() -> None:
    n = 3 * SLICE + 1
    vms, entities, providers = fleet_of(n)
    beats: list[int] = []
    async with ticker() as ticks:
        before = ticks[0]
        routes = await resolve(
            "w", vms, entities.get, providers, beat=lambda: beats.append(ticks[0])
        )
        assert ticks[0] - before >= 3  # the loop ran between slices
        assert len(beats) >= 3 and len(routes) == n
        store = await open_store(f"memory://{uuid.uuid4().hex}")

        async def gone(name: str) -> bool:
            return False

        try:
            first = await publish(store, "w", routes, gone)
            assert first.written == n
            beats.clear()
            before = ticks[0]
            again = await publish(store, "w", routes, gone, beat=lambda: beats.append(1))
            assert again.written == 0  # converged: nothing to await but the slices
            assert ticks[0] - before >= 3 and len(beats) >= 3
        finally:
            await store.close()


async def test_a_converged_publish_makes_each_routes_key_within_its_slice(
    monkeypatch: Any,
) -> None:
    """The keys of the routes wanted were made all at once after the slices (10,000 of them,
    each quoted twice, held the loop ~100 ms): each is made once, in its route's slice."""
    from shoal.discovery import routes as routes_module

    n = 3 * SLICE + 1
    vms, entities, providers = fleet_of(n)
    routes = await resolve("w", vms, entities.get, providers)
    store = await open_store(f"memory://{uuid.uuid4().hex}")

    async def gone(name: str) -> bool:
        return False

    try:
        await publish(store, "w", routes, gone)
        made: list[int] = []
        real = routes_module.route_key
        async with ticker() as ticks:

            def counted(workspace: str, name: str) -> str:
                made.append(ticks[0])
                return real(workspace, name)

            monkeypatch.setattr(routes_module, "route_key", counted)
            again = await publish(store, "w", routes, gone)
        assert again.written == 0 and again.deleted == 0
        assert len(made) == n  # once per route
        assert max(made.count(tick) for tick in set(made)) <= SLICE
    finally:
        await store.close()


class StagingCache:
    """An `EntityCache` stand-in for `ProvidersPhase._provider`: records on which turn of
    the event loop each name was staged."""

    def __init__(self, ticks: list[int]) -> None:
        self.ticks = ticks
        self.staged: list[int] = []

    def peek(self, name: str) -> None:
        return None

    def stage_create(self, name: str, fields: dict[str, Any]) -> None:
        pass

    def stage_provider_link(self, name: str, ref: str) -> None:
        self.staged.append(self.ticks[0])

    def linked_to(self, ref: str) -> list[str]:
        return []


async def test_the_providers_phase_stages_a_providers_names_a_slice_at_a_time() -> None:
    """A provider serving 10,000 models had them all staged in one hold of the loop (~160
    ms): the phase yields, and beats the controller's heartbeat, every `SLICE` names."""
    from shoal.catalog.providers import ProvidersPhase, ProvidersResult

    n = 3 * SLICE + 1
    _, _, providers = fleet_of(0)
    beats: list[int] = []

    class Calls:
        def beat(self) -> None:
            beats.append(1)

        async def update(self, *args: Any) -> Provider:
            return providers["w/p"]

    phase = ProvidersPhase(Calls(), None, None)  # type: ignore[arg-type]
    result = ProvidersResult(None, dict(providers))
    async with ticker() as ticks:
        cache = StagingCache(ticks)
        names = [f"m{i}" for i in range(n)]
        await phase._provider("w", providers["w/p"], names, cache, result)  # type: ignore[arg-type]
    assert len(cache.staged) == n
    assert max(cache.staged.count(tick) for tick in set(cache.staged)) <= SLICE
    assert len(beats) >= 3
    assert result.served == set(names)


async def test_a_route_of_more_targets_than_a_frontend_reads_is_not_published_and_says_why() -> (
    None
):
    """A virtual model of 100 targets whose entities have several providers each resolved to
    a route of more than `MAX_TARGETS` targets: published, then skipped by every frontend as
    malformed. Now it is not published (the route held stays in force) and its failure names
    the bound; the other routes are published."""
    from shoal.discovery.routes import MAX_TARGETS

    many = Route(
        "w", "many", tuple(UrlTarget("http://x/v1", f"m{i}", 1) for i in range(MAX_TARGETS + 1))
    )
    few = Route("w", "few", (UrlTarget("http://x/v1", "m0", 1),))
    store = await open_store(f"memory://{uuid.uuid4().hex}")

    async def gone(name: str) -> bool:
        return False

    try:
        done = await publish(store, "w", [many, few], gone)
        assert done.written == 1 and list(done.failed) == ["many"]
        assert f"over {MAX_TARGETS}" in done.failed["many"]
        held = await store.get_prefix("shoal/v1/routes/w/")
        assert [kv.key.rsplit("/", 1)[1] for kv in held.items] == ["few"]
    finally:
        await store.close()


async def test_an_oversized_listing_is_judged_a_slice_at_a_time_and_never_encoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A provider listing 100,000 names had them deduplicated, sorted, checked, built into
    `served_models` and encoded in one hold of the loop (~280 ms), only to find them over
    `SERVED_MODELS_BYTES`: names are checked a `SLICE` at a time now, the size counted as
    they are, and an oversized listing's `served_models` are never built."""
    from shoal.catalog import providers as providers_module
    from shoal.catalog.providers import SERVED_MODELS_BYTES, ProvidersPhase, ProvidersResult

    names = [f"org/model-name-{i:06d}" for i in range(12_000)]  # 85 bytes each as JSON
    assert 85 * len(names) > SERVED_MODELS_BYTES
    _, _, providers = fleet_of(0)
    written: list[dict[str, Any]] = []

    class Calls:
        def beat(self) -> None:
            pass

        async def update(self, kind: Any, ws: str, name: str, changes: dict[str, Any],
                         version: int) -> Provider:  # fmt: skip
            written.append(changes)
            return providers["w/p"]

    async with ticker() as ticks:
        checked: list[int] = []
        real = providers_module.ENTITY_NAME

        class Checking:
            def fullmatch(self, name: str) -> Any:
                checked.append(ticks[0])
                return real.fullmatch(name)

        monkeypatch.setattr(providers_module, "ENTITY_NAME", Checking())
        phase = ProvidersPhase(Calls(), None, None)  # type: ignore[arg-type]
        result = ProvidersResult(None, dict(providers))
        cache = StagingCache(ticks)
        await phase._provider("w", providers["w/p"], names, cache, result)  # type: ignore[arg-type]
    assert len(checked) == len(names)
    assert max(checked.count(tick) for tick in set(checked)) <= SLICE
    assert cache.staged == []  # nothing staged, nothing built
    assert (
        written[-1]["status"] == "ERROR" and "SERVED_MODELS_BYTES" in written[-1]["status_message"]
    )
    served_models = [{"model_entity": n, "served_model_name": n} for n in names]
    assert (
        f"would be {len(msgspec.json.encode(served_models))} bytes" in written[-1]["status_message"]
    )  # counted exactly


async def test_each_keeps_its_writes_in_a_few_tasks_and_yields_between_slices() -> None:
    """`each` (a cold pass's entity and passthrough creates: 10,000 for a provider serving
    10,000 models) made a task per item at once: 10,000 tasks, ~100 ms of one turn of the
    event loop before the first write, 100,000 items 1.2 s. It runs `WRITES_AT_ONCE` workers
    over the items now, and work that finds nothing to wait on still lets the loop run every
    `SLICE` items."""
    from shoal.catalog.calls import WRITES_AT_ONCE, each

    tasks: list[int] = []

    async def write(_item: int) -> None:
        tasks.append(len(asyncio.all_tasks()))
        await asyncio.sleep(0)

    base = len(asyncio.all_tasks())
    await each(range(3 * SLICE), write)
    assert len(tasks) == 3 * SLICE
    assert max(tasks) <= base + WRITES_AT_ONCE, max(tasks)

    async with ticker() as ticks:
        turns: list[int] = []

        async def nothing_to_write(_item: int) -> None:
            turns.append(ticks[0])

        await each(range(4 * SLICE), nothing_to_write)
    assert len(turns) == 4 * SLICE
    assert max(turns.count(tick) for tick in set(turns)) <= SLICE


async def test_a_pass_judges_and_cleans_up_its_virtual_models_a_slice_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before resolving, the pass judged every virtual model (its entities readable?) and the
    providers phase looked at each for cleanup, each in one hold of the event loop: 10,000
    of them held it ~10 ms (27-48 ms sampled on a loaded machine, with what ran beside).
    Both go a slice at a time now."""
    from shoal.catalog import controller as controller_module
    from shoal.catalog.providers import ProvidersPhase, ProvidersResult

    n = 3 * SLICE + 1
    vms, _, providers = fleet_of(n)
    vms = [vm.model_copy(update={"autoprovisioned": True}) for vm in vms]

    class Served(set[str]):
        """The entities served, noting the turn each virtual model is looked at in."""

        def __init__(self, ticks: list[int]) -> None:
            super().__init__(vm.default_model for vm in vms)
            self.ticks, self.looked = ticks, []

        def __contains__(self, name: object) -> bool:
            self.looked.append(self.ticks[0])
            return super().__contains__(name)

    class Calls:
        def beat(self) -> None:
            pass

    phase = ProvidersPhase(Calls(), None, None)  # type: ignore[arg-type]
    async with ticker() as ticks:
        result = ProvidersResult(list(vms), dict(providers))
        result.served = served = Served(ticks)
        await phase._cleanup("w", result)
        judged: list[int] = []
        real_names = controller_module._names

        def names(vm: VirtualModel) -> set[str]:
            judged.append(ticks[0])
            return real_names(vm)

        monkeypatch.setattr(controller_module, "_names", names)
        unreadable: set[str] = set()
        await resolve(
            "w", controller_module.judged(vms, unreadable), lambda _: None, providers,
        )  # fmt: skip
    assert result.virtual_models == vms  # all served: all kept
    assert len(served.looked) == len(judged) == n
    for turns in (served.looked, judged):
        assert max(turns.count(tick) for tick in set(turns)) <= SLICE
