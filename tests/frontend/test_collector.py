"""What a frontend's fleet leaves to Python's garbage collector.

A registry is all live objects, several per instance: full collections over it find nothing
and, at 100,000 instances, held the event loop 500-700 ms each while it loaded. With
`FrontendConfig.freeze_loading` (which `shoal frontend` sets) what the first load builds is
frozen out of the collector (`gc.freeze()`). That is only safe if what leaves later is
freed by its reference count: an instance that leaves must leave no reference cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import pytest

from shoal.discovery import Discovery, InstanceInfo, ModelKey
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.http.upstream import Upstream
from shoal.frontend.registry.freeze import freeze_while_loading
from shoal.store import Store
from tests.frontend.conftest import StartWorker
from tests.helpers import wait_for

FLEET = 300


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    """Whatever a test froze goes back to the collector: the test process is not a
    frontend's own."""
    gc.unfreeze()
    yield
    gc.unfreeze()


async def start_over_a_fleet(
    start_worker: StartWorker, store: Store, tmp_path: Path, *, freeze: bool
) -> tuple[Frontend, Discovery, InstanceInfo]:
    worker = await start_worker(register=False)
    card = msgspec.structs.replace(worker.card(), metadata_files={})  # joins with no fetch
    discovery = Discovery(store)
    info = InstanceInfo("default", "backend", "generate", 0, f"{worker.url}/v1", worker.url)
    for i in range(FLEET):
        each = msgspec.structs.replace(info, instance_id=0x1000 + i)
        await discovery.register_instance(each, lease=0)
        await discovery.register_model(ModelKey(info.endpoint_id, 0x1000 + i), card, lease=0)
    frontend = Frontend(
        FrontendConfig(
            port=0, cache_dir=tmp_path / "cache", reconcile_interval=3600, freeze_loading=freeze
        ),
        discovery=Discovery(store),
    )
    await frontend.start()
    await wait_for(lambda: len(frontend.registry) == FLEET, message="the fleet joined")
    return frontend, discovery, info


def card_model(frontend: Frontend) -> str:
    (name,) = frontend.registry.models
    return name


def upstreams(frontend: Frontend) -> list[Upstream]:
    return [m.upstream for m in frontend.registry._members.values()]


def tracked_ids() -> set[int]:
    return {id(o) for o in gc.get_objects()}  # (the frozen ones are in no generation)


async def test_the_first_load_is_frozen_out_of_the_collector_when_asked(
    start_worker: StartWorker, store: Store, tmp_path: Path
) -> None:
    frontend, _, _ = await start_over_a_fleet(start_worker, store, tmp_path, freeze=True)
    try:
        watcher = frontend.watcher
        assert watcher is not None
        await wait_for(
            lambda: not any(t.get_name() == "discovery:gc-freeze" for t in watcher._tasks)
        )
        tracked = tracked_ids()
        members = list(frontend.registry._members.values())
        registrations = list(watcher.registrations.values())
        assert len(members) == len(registrations) == FLEET
        assert not any(id(m) in tracked for m in members)
        assert not any(id(r) in tracked for r in registrations)
        assert gc.get_freeze_count() > FLEET * 4
    finally:
        await frontend.stop()


async def test_a_burst_of_joins_after_the_load_is_frozen_out_of_the_collector_too(
    start_worker: StartWorker, store: Store, tmp_path: Path
) -> None:
    """A worker announcing thousands of adapters after the frontend loaded: without a
    freeze, each full collection went through all of them (20,000 joins: full collections
    of 30-128 ms, growing, finding nothing). The burst is frozen as the first load is, and
    the thresholds come back once it is over."""
    before = gc.get_threshold()
    frontend, discovery, info = await start_over_a_fleet(start_worker, store, tmp_path, freeze=True)
    try:
        watcher = frontend.watcher
        assert watcher is not None
        await wait_for(
            lambda: not any(t.get_name() == "discovery:gc-freeze" for t in watcher._tasks)
        )
        assert gc.get_threshold() == before
        card = msgspec.structs.replace(next(iter(frontend.registry._members.values())).card)
        burst = 3000
        lifted = []

        async def watch_thresholds() -> None:
            while True:
                lifted.append(gc.get_threshold()[2])
                await asyncio.sleep(0.01)  # (sampling, not synchronisation)

        sampler = asyncio.create_task(watch_thresholds())
        for i in range(burst):
            key = ModelKey(info.endpoint_id, 0x1000 + i % FLEET, f"lora-{i}")
            await discovery.register_model(key, card, lease=0)
        await wait_for(lambda: len(frontend.registry) == FLEET + burst, message="the burst joined")
        await wait_for(lambda: max(lifted) > 10**6, message="full collections held off")
        await wait_for(lambda: gc.get_threshold() == before, message="thresholds back", timeout=10)
        sampler.cancel()
        tracked = tracked_ids()
        members = list(frontend.registry._members.values())
        unfrozen = sum(id(m) in tracked for m in members)
        assert unfrozen < burst // 10, f"{unfrozen} of {len(members)} members still tracked"
    finally:
        await frontend.stop()


async def test_an_embedded_frontend_leaves_the_collector_alone_by_default(
    start_worker: StartWorker, store: Store, tmp_path: Path
) -> None:
    frontend, _, _ = await start_over_a_fleet(start_worker, store, tmp_path, freeze=False)
    try:
        tracked = tracked_ids()
        assert gc.get_freeze_count() == 0
        assert all(id(m) in tracked for m in frontend.registry._members.values())
    finally:
        await frontend.stop()


async def test_an_instance_that_leaves_leaves_no_reference_cycle(
    start_worker: StartWorker, store: Store, tmp_path: Path
) -> None:
    """What a frozen registry keeps for good is a cycle among its objects that dies: the
    instances that leave must be freed by their reference counts alone."""
    frontend, discovery, info = await start_over_a_fleet(
        start_worker, store, tmp_path, freeze=False
    )
    leaving = FLEET // 2
    try:
        # Requests first, so that instances leave with connections open to them.
        async with aiohttp.ClientSession() as http:
            for _ in range(leaving):
                body = {
                    "model": card_model(frontend),
                    "messages": [{"role": "user", "content": "hi"}],
                }
                async with http.post(f"{frontend.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
        assert sum(len(u.idle) for u in upstreams(frontend)) >= leaving // 2
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        for i in range(leaving):
            await discovery.unregister_model(ModelKey(info.endpoint_id, 0x1000 + i))
            await discovery.unregister_instance(info.endpoint_id, 0x1000 + i)
        await wait_for(lambda: len(frontend.registry) == FLEET - leaving, message="they left")
        gc.collect()
        ours = Counter(
            type(o).__qualname__
            for o in gc.garbage
            if type(o).__module__.startswith(("shoal", "httptools"))
        )
        # (the selector event loop's transport is a cycle of its own, one per closed
        # connection: the standard library's, and not uvloop's, which `shoal frontend` runs;
        # and what an earlier test on this process left may die in this window, once: a
        # cycle per instance that left shows as at least one object per instance)
        per_instance = [(name, n) for name, n in ours.most_common() if n >= leaving // 2]
        assert per_instance == [], ours.most_common(10)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        await frontend.stop()


async def test_no_full_collection_runs_while_loading_and_the_thresholds_come_back() -> None:
    """While it freezes, the oldest generation is never collected (its threshold lifted);
    once loaded and fetched the thresholds are what they were, also when cancelled."""
    before = gc.get_threshold()
    loaded, fetched = asyncio.Event(), asyncio.Event()
    freezing = asyncio.create_task(freeze_while_loading(loaded, fetched))
    await wait_for(lambda: gc.get_threshold()[2] > 10**6, message="lifted while loading")
    assert gc.get_threshold()[:2] == before[:2]
    loaded.set()
    fetched.set()
    await asyncio.wait_for(freezing, 5)
    assert gc.get_threshold() == before
    cancelled = asyncio.create_task(freeze_while_loading(asyncio.Event(), asyncio.Event()))
    await wait_for(lambda: gc.get_threshold()[2] > 10**6, message="lifted again")
    cancelled.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await cancelled
    assert gc.get_threshold() == before


async def test_two_loads_in_one_process_put_the_thresholds_back_once_both_end() -> None:
    """Two frontends loading in one process: the thresholds stay lifted until the second
    ends, whichever ends first, and are then what they were before the first."""
    before = gc.get_threshold()
    events = [(asyncio.Event(), asyncio.Event()) for _ in range(2)]
    loads = [asyncio.create_task(freeze_while_loading(*pair)) for pair in events]
    await wait_for(lambda: gc.get_threshold()[2] > 10**6, message="lifted while loading")
    for loaded, fetched in events[:1]:
        loaded.set()
        fetched.set()
    await asyncio.wait_for(loads[0], 5)
    assert gc.get_threshold()[2] > 10**6  # (the second still loads)
    for loaded, fetched in events[1:]:
        loaded.set()
        fetched.set()
    await asyncio.wait_for(loads[1], 5)
    assert gc.get_threshold() == before
