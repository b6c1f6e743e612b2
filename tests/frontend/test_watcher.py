"""The model watcher: events, the generation fence, and reconciliation repairing what events miss."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from shoal.cards import MetadataFile, ModelCard
from shoal.discovery import (
    Added,
    Discovery,
    DiscoveryEvent,
    EndpointId,
    InstanceInfo,
    ModelInstance,
    ModelKey,
    Query,
    Removed,
)
from shoal.frontend import Frontend
from shoal.frontend.registry.metadata import MetadataCache
from shoal.frontend.registry.metrics import FrontendMetrics
from shoal.frontend.registry.registrations import JOIN_BATCH, JOIN_LINES, State
from shoal.frontend.registry.registry import Registry
from shoal.frontend.registry.watcher import START_SLICE, ModelWatcher
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import FilteringDiscovery, serving
from tests.helpers import LoopTurns, wait_for
from tests.membership.support import add_endpoint, remove_endpoint

INTERVAL = 0.4  # the reconcile interval of these tests


@pytest.fixture(params=["memory", "sqlite", "etcd"])
def backend(request: pytest.FixtureRequest) -> str:
    """Reconciliation is proven on every store backend."""
    return str(request.param)


def repairs(frontend: Frontend, action: str) -> float:
    value = frontend.metrics.registry.get_sample_value(
        "shoal_frontend_reconcile_repairs_total", {"action": action}
    )
    return value or 0.0


async def listed_models(frontend: Frontend) -> list[str]:
    async with aiohttp.ClientSession() as session:
        response = await session.get(f"{frontend.url}/v1/models")
        return [m["id"] for m in (await response.json())["data"]]


def drop(kind: type, model: str | None = None) -> object:
    def rule(event: DiscoveryEvent) -> bool:
        if not isinstance(event, kind):
            return False
        return model is None or (
            isinstance(event, Added) and event.model.card.display_name == model
        )

    return rule


async def test_dropped_added_is_served_within_one_reconcile_interval(
    discovery: FilteringDiscovery, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    discovery.drop = drop(Added)  # type: ignore[assignment]
    frontend = await start_frontend(reconcile_interval=INTERVAL)
    await start_worker()
    await wait_for(lambda: discovery.dropped, message="the Added event was dropped")
    await wait_for(lambda: serving(frontend), timeout=INTERVAL * 2 + 1)
    assert await listed_models(frontend) == ["mock-llm"]
    assert repairs(frontend, "register") == 1


async def test_dropped_removed_ghost_leaves_models_within_one_reconcile_interval(
    discovery: FilteringDiscovery, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    discovery.drop = drop(Removed)  # type: ignore[assignment]
    worker = await start_worker()
    frontend = await start_frontend(reconcile_interval=INTERVAL)
    await wait_for(lambda: serving(frontend))
    await worker.unregister()
    await wait_for(lambda: discovery.dropped, message="the Removed event was dropped")
    await wait_for(lambda: "mock-llm" not in frontend.registry.models, timeout=INTERVAL * 2 + 1)
    assert await listed_models(frontend) == []
    assert repairs(frontend, "remove") == 1


async def test_metadata_fetch_failing_first_times_completes_on_a_later_pass(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker(register=False)
    worker.metadata_failures = 2
    frontend = await start_frontend(reconcile_interval=INTERVAL)
    await worker.register(frontend.discovery.store)  # type: ignore[union-attr]
    await wait_for(lambda: worker.metadata_fetches >= 1)
    assert not serving(frontend)  # incomplete: not listed
    assert await listed_models(frontend) == []
    await wait_for(lambda: serving(frontend), timeout=INTERVAL * 3 + 2)
    assert worker.metadata_fetches == 3
    assert repairs(frontend, "retry") == 2


async def test_slow_fetch_in_reconciliation_does_not_delay_a_new_workers_added(
    discovery: FilteringDiscovery, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    discovery.drop = drop(Added, "slow")  # type: ignore[assignment]
    frontend = await start_frontend(reconcile_interval=INTERVAL)
    slow = await start_worker("slow", register=False)
    slow.metadata_hang.clear()
    await slow.register(discovery.store)
    # Reconciliation registers the dropped card and starts its fetch, which hangs.
    await wait_for(lambda: slow.metadata_fetches == 1, timeout=INTERVAL * 2 + 1)
    fast = await start_worker("fast")
    await wait_for(lambda: serving(frontend, "fast"), timeout=1.0)
    # The loop does not wait on the fetch: it keeps passing, healthy.
    passes = frontend.metrics.reconcile_runs._value.get()
    await wait_for(lambda: frontend.metrics.reconcile_runs._value.get() >= passes + 4)
    assert slow.metadata_fetches == 1  # the fetch in flight is not started again
    async with aiohttp.ClientSession() as session:
        for path in ("/health", "/health/controllers", "/ready"):
            assert (await session.get(f"{frontend.url}{path}")).status == 200
    slow.metadata_hang.set()
    await wait_for(lambda: serving(frontend, "slow"))
    assert fast.requests == 0


async def test_discovery_failure_during_cleanup_removes_nothing_then_next_pass_does(
    discovery: FilteringDiscovery, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    discovery.drop = drop(Removed)  # type: ignore[assignment]
    stale, kept = await start_worker(), await start_worker()
    frontend = await start_frontend(reconcile_interval=INTERVAL)
    await wait_for(lambda: serving(frontend, instances=2))
    discovery.list_failures = 1
    calls = discovery.list_calls
    await stale.unregister()
    await wait_for(lambda: len(discovery.dropped) == 1)

    def failures() -> float:
        value = frontend.metrics.registry.get_sample_value(
            "shoal_frontend_reconcile_failures_total", {"stage": "list"}
        )
        return value or 0.0

    await wait_for(lambda: failures() == 1, timeout=INTERVAL * 2 + 1)
    assert discovery.list_calls > calls
    assert stale.key in frontend.registry and kept.key in frontend.registry  # nothing removed
    await wait_for(lambda: stale.key not in frontend.registry, timeout=INTERVAL * 2 + 1)
    assert kept.key in frontend.registry
    assert serving(frontend, instances=1)


async def test_one_entry_failing_to_repair_does_not_stop_the_others(
    discovery: FilteringDiscovery, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    discovery.drop = drop(Added)  # type: ignore[assignment]
    frontend = await start_frontend(reconcile_interval=60)
    first, second = await start_worker("first"), await start_worker("second")
    await wait_for(lambda: len(discovery.dropped) == 2)
    watcher = frontend.watcher
    assert watcher is not None
    broken = min(first.key, second.key)
    repair = watcher._repair

    def failing_repair(key, model):  # type: ignore[no-untyped-def]
        if key == broken:
            raise RuntimeError("injected repair failure")
        return repair(key, model)

    watcher._repair = failing_repair  # type: ignore[method-assign]
    done = await watcher.reconcile()
    assert done == {"register": 1}
    assert broken not in frontend.registry
    assert max(first.key, second.key) in frontend.registry
    watcher._repair = repair  # type: ignore[method-assign]
    assert await watcher.reconcile() == {"register": 1}  # retried on the next pass


async def test_stale_listing_never_removes_a_card_added_after_it(
    discovery: FilteringDiscovery, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=60)
    watcher = frontend.watcher
    assert watcher is not None
    discovery.hold_listings = asyncio.Event()
    pass_ = asyncio.create_task(watcher.reconcile())
    await wait_for(lambda: discovery.list_calls >= 2)  # listed (empty), now held
    worker = await start_worker()
    await wait_for(lambda: serving(frontend))  # the Added event, newer than the listing
    discovery.hold_listings.set()
    assert await pass_ == {}
    assert worker.key in frontend.registry


async def test_stale_listing_never_resurrects_a_removed_card(
    discovery: FilteringDiscovery, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await start_frontend(reconcile_interval=60)
    await wait_for(lambda: serving(frontend))
    watcher = frontend.watcher
    assert watcher is not None
    discovery.hold_listings = asyncio.Event()
    calls = discovery.list_calls
    pass_ = asyncio.create_task(watcher.reconcile())
    await wait_for(lambda: discovery.list_calls > calls)  # listed (with the worker), now held
    await worker.unregister()
    await wait_for(lambda: worker.key not in watcher.registrations)
    discovery.hold_listings.set()
    assert await pass_ == {}
    assert worker.key not in watcher.registrations


async def test_registration_finishing_after_a_newer_removal_does_not_resurrect_it(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker(register=False)
    worker.metadata_hang.clear()
    frontend = await start_frontend(reconcile_interval=60)
    watcher = frontend.watcher
    assert watcher is not None
    await worker.register(watcher.discovery.store)
    await wait_for(lambda: worker.metadata_fetches == 1)
    registration = watcher.registrations[worker.key]
    assert registration.state is State.PENDING and registration.task is not None
    fetch = registration.task
    await worker.unregister()
    await wait_for(lambda: worker.key not in watcher.registrations)
    worker.metadata_hang.set()
    await asyncio.gather(fetch, return_exceptions=True)
    await asyncio.sleep(0)
    assert "mock-llm" not in frontend.registry.models


async def test_events_are_handled_while_a_fetch_is_slow(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    slow = await start_worker("slow", register=False)
    slow.metadata_hang.clear()
    frontend = await start_frontend(reconcile_interval=60)
    await slow.register(frontend.watcher.discovery.store)  # type: ignore[union-attr]
    await wait_for(lambda: slow.metadata_fetches == 1)
    await start_worker("fast")
    await wait_for(lambda: serving(frontend, "fast"), timeout=1.0)
    assert not serving(frontend, "slow")
    slow.metadata_hang.set()
    await wait_for(lambda: serving(frontend, "slow"))


async def test_metadata_is_fetched_once_and_cached_on_disk_by_checksum(
    start_worker: StartWorker, start_frontend: StartFrontend, tmp_path: Path
) -> None:
    first = await start_worker()
    cache = tmp_path / "shared-cache"
    one = await start_frontend(cache_dir=cache)
    await wait_for(lambda: serving(one))
    second = await start_worker()  # same model and files: no fetch needed
    await wait_for(lambda: serving(one, instances=2))
    assert first.metadata_fetches + second.metadata_fetches == 1
    files = list(cache.iterdir())
    assert [f.name for f in files] == [
        first.card().metadata_files["config.json"].checksum.replace(":", "-")
    ]
    two = await start_frontend(cache_dir=cache)  # a restart: the disk cache is reused
    await wait_for(lambda: serving(two, instances=2))
    assert first.metadata_fetches + second.metadata_fetches == 1


async def test_metadata_not_matching_its_checksum_keeps_the_card_out(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker(register=False)
    card_bytes = worker.metadata
    worker.metadata = b'{"tampered": true}'  # served bytes differ from the card's checksum
    original_card = worker.card

    def card():  # type: ignore[no-untyped-def]
        served, worker.metadata = worker.metadata, card_bytes
        try:
            return original_card()
        finally:
            worker.metadata = served

    worker.card = card  # type: ignore[method-assign]
    frontend = await start_frontend(reconcile_interval=60)
    await worker.register(frontend.watcher.discovery.store)  # type: ignore[union-attr]
    watcher = frontend.watcher
    assert watcher is not None
    await wait_for(lambda: worker.metadata_fetches == 1)
    await wait_for(lambda: watcher.registrations[worker.key].error is not None)
    assert "checksum" in (watcher.registrations[worker.key].error or "")
    assert "mock-llm" not in frontend.registry.models


async def test_taint_updates_reach_routing(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend))
    await worker.taint("draining")
    await wait_for(lambda: not serving(frontend))
    assert "mock-llm" in frontend.registry.models  # still known: listed again when untainted
    await worker.taint()
    await wait_for(lambda: serving(frontend))


async def test_unsorted_taints_from_another_writer_are_not_repaired_every_pass(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await start_frontend(reconcile_interval=3600)
    await wait_for(lambda: serving(frontend))
    card = worker.card()
    unsorted = msgspec.structs.replace(card, runtime_config={"taints": ["zeta", "alpha", "zeta"]})
    assert worker.lease is not None
    await store.put(worker.key.key, unsorted.to_json(), lease=worker.lease.id)
    watcher = frontend.watcher
    assert watcher is not None
    await wait_for(lambda: watcher.registrations[worker.key].model.card.taints == ("alpha", "zeta"))
    version = frontend.registry.version
    for _ in range(3):
        assert await watcher.reconcile() == {}
    assert frontend.registry.version == version


class BrokenStreams(FilteringDiscovery):
    """Every watch stream fails at once; counts listings in flight at the same time."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.stream_failures = 0
        self.listing = 0
        self.most_listing = 0

    async def list_and_watch(
        self, query: Query | None = None, *, after_listing: bool = False
    ) -> AsyncIterator[DiscoveryEvent]:
        self.stream_failures += 1
        raise ConnectionError("injected stream failure")
        yield  # pragma: no cover - makes this an async generator

    async def list(
        self, query: Query | None = None, *, on_answer: Callable[[], None] | None = None
    ) -> list[ModelInstance]:
        self.listing += 1
        self.most_listing = max(self.most_listing, self.listing)
        try:
            return await super().list(query, on_answer=on_answer)
        finally:
            self.listing -= 1


@pytest.mark.parametrize("backend", ["memory"])
async def test_failing_streams_run_one_resync_at_a_time(store: Store, tmp_path: Path) -> None:
    discovery = BrokenStreams(store)
    watcher = ModelWatcher(
        discovery, Registry(), MetadataCache(tmp_path / "cache"), FrontendMetrics()
    )
    await watcher.start()
    try:
        discovery.hold_listings = asyncio.Event()  # the store stalls: resyncs cannot finish
        failures = discovery.stream_failures
        await wait_for(lambda: discovery.stream_failures >= failures + 4, message="failures")
        assert discovery.most_listing == 1
        discovery.hold_listings.set()  # the store answers again: the pending resync finishes
        await wait_for(lambda: discovery.listing == 0, message="the resync to finish")
        assert discovery.most_listing == 1
    finally:
        await watcher.stop()


async def test_a_pass_rejoins_a_joined_key_the_registry_lost_among_settled_ones(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """The pass skips the keys joined with the very card listed a slice at a time; a
    registration still marked joined whose member is gone is not one of them: it rejoins."""
    frontend = await start_frontend(reconcile_interval=3600)
    await start_worker()
    await wait_for(lambda: serving(frontend))
    assert frontend.watcher is not None
    [key] = list(frontend.registry._members)
    frontend.registry.leave(key)  # (the registration still says joined)
    assert frontend.watcher.registrations[key].state is State.JOINED
    repaired = await frontend.watcher.reconcile()
    assert repaired == {"rejoin": 1}
    assert frontend.registry.member(key) is not None
    assert await frontend.watcher.reconcile() == {}  # settled now: nothing to do


class HeldFetches(MetadataCache):
    """A cache where no file is cached and every fetch waits for `release`: the fetches of
    every model then end in one wake-up of the loop, as a cold start's do when the cache
    writer answers a batch of files at once."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.release = asyncio.Event()
        self.fetched: set[str] = set()
        self.waiting = 0  # fetches waiting for `release`

    def has(self, file: MetadataFile) -> bool:
        return file.checksum in self.fetched

    async def fetch(self, card: ModelCard) -> None:
        self.waiting += 1
        await self.release.wait()
        self.fetched.update(f.checksum for f in card.metadata_files.values())


@pytest.mark.parametrize("backend", ["memory"])
async def test_two_thousand_fetches_ending_at_once_join_their_cards_in_slices(
    store: Store, tmp_path: Path
) -> None:
    models = 2000
    cache = HeldFetches(tmp_path / "cache")
    watcher = ModelWatcher(Discovery(store), Registry(), cache, FrontendMetrics())
    endpoint = EndpointId("default", "backend", "generate")
    for i in range(models):
        name = f"model-{i}"
        card = ModelCard.build(
            display_name=name, slug=name, source=f"test/{name}", model_types=["chat"],
            context_length=4096,
            metadata_files={"config.json": {"url": f"http://127.0.0.1:9/{name}",
                                            "checksum": f"sha256:{i:064x}", "size": 1}},
        )  # fmt: skip
        url = "http://127.0.0.1:9"
        info = InstanceInfo("default", "backend", "generate", 0x100 + i, f"{url}/v1", url)
        watcher.handle(Added(ModelInstance(ModelKey(endpoint, 0x100 + i), card, info)))
    assert watcher.fetching == models and len(watcher.registry) == 0
    await wait_for(lambda: cache.waiting == models, message="every fetch waits")
    joined = LoopTurns().wrap(watcher.registry, "join")
    cache.release.set()
    try:
        await wait_for(lambda: len(watcher.registry) == models, message="every card joined")
    finally:
        await joined.stop()
    # Each fetch joining its own card in the wake-up they share held the loop for all of
    # them: 91 ms here on a quiet machine. Counted, not timed: `JOIN_BATCH` cards at most
    # join in one turn of the loop.
    assert joined.on_loop == models
    assert joined.most_per_turn <= JOIN_BATCH, f"{joined.most_per_turn} cards in one turn"
    assert watcher.fetching == 0 and watcher.no_fetches.is_set()
    await watcher.stop()


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_the_start_lists_the_store_once_and_its_streams_miss_nothing_written_meanwhile(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The streams start from the listing the start applied: the fleet is listed once (at
    100,000 instances a second listing was 200,000 keys read, parsed and reported for
    nothing), and what was written while the listing was applied still arrives."""
    discovery = FilteringDiscovery(store)
    keys = [await add_endpoint(discovery, "default", 0x100 + i) for i in range(3)]
    listings = 0
    listing: set[asyncio.Task[Any] | None] = set()  # (a store's listing may call another)

    def counted(method: Callable[..., Any]) -> Callable[..., Any]:
        async def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal listings
            task = asyncio.current_task()
            if task in listing:
                return await method(*args, **kwargs)
            listings += 1
            listing.add(task)
            try:
                return await method(*args, **kwargs)
            finally:
                listing.discard(task)

        return call

    for name in ("get_prefixes", "get_prefixes_changed"):
        monkeypatch.setattr(store, name, counted(getattr(store, name)))
    discovery.hold_listings = asyncio.Event()  # the listing goes stale before it is applied
    watcher = ModelWatcher(
        discovery, Registry(), MetadataCache(tmp_path / "cache"), FrontendMetrics()
    )
    starting = asyncio.create_task(watcher.start())
    try:
        await wait_for(lambda: discovery.list_calls == 1, message="the first listing")
        await remove_endpoint(discovery, keys[0])
        new = await add_endpoint(discovery, "default", 0x200)
        discovery.hold_listings.set()
        await starting
        await wait_for(
            lambda: set(watcher.registrations) == {keys[1], keys[2], new},
            message="the changes written while the listing was applied",
        )
        assert listings == 1
        assert discovery.list_calls == 1
        later = await add_endpoint(discovery, "default", 0x201)
        await wait_for(lambda: later in watcher.registrations, message="a later change")
    finally:
        await watcher.stop()
        starting.cancel()


async def test_the_first_load_logs_its_joins_at_debug_and_later_ones_at_info(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cold start does not write a line per model (10,000 models: 0.3 s of the loop):
    its joins at DEBUG, one line once its metadata is fetched; a model that comes later
    is named at INFO."""
    caplog.set_level(logging.INFO, logger="shoal.frontend.registry.registrations")
    discovery = FilteringDiscovery(store)
    keys = [await add_endpoint(discovery, "default", 0x100 + i, model=f"m{i}") for i in range(3)]
    watcher = ModelWatcher(
        discovery, Registry(), MetadataCache(tmp_path / "cache"), FrontendMetrics()
    )
    try:
        await watcher.start()
        await wait_for(lambda: len(watcher.registry) == len(keys), message="joined")

        def lines(text: str) -> list[str]:
            return [r.getMessage() for r in caplog.records if text in r.getMessage()]

        await wait_for(lambda: lines("first load"), message="the load's line")
        assert lines("joined (") == []
        await add_endpoint(discovery, "default", 0x200, model="later")
        await wait_for(lambda: lines("joined ("), message="a later model at INFO")
        assert [line.split("'")[1] for line in lines("joined (")] == ["later"]
    finally:
        await watcher.stop()


async def test_a_burst_of_new_models_after_the_load_is_named_a_few_lines_a_second_and_counted(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker announcing its 20,000 adapters to a running frontend wrote 20,000 INFO
    lines (a third of the joins' CPU): the first `JOIN_LINES` new models of a second are
    named, the rest counted in one line when the second is over (each at DEBUG)."""
    caplog.set_level(logging.INFO, logger="shoal.frontend.registry.registrations")
    discovery = FilteringDiscovery(store)
    watcher = ModelWatcher(
        discovery, Registry(), MetadataCache(tmp_path / "cache"), FrontendMetrics()
    )
    try:
        await watcher.start()

        def lines(text: str) -> list[str]:
            return [r.getMessage() for r in caplog.records if text in r.getMessage()]

        await wait_for(lambda: lines("first load"), message="the load's line")
        burst = JOIN_LINES * 4
        for i in range(burst):
            await add_endpoint(discovery, "default", 0x300 + i, model=f"burst{i}")
        await wait_for(lambda: len(watcher.registry) == burst, message="the burst joined")

        def counted() -> int:
            found = (re.search(r"(\d+) more models joined", line) for line in lines("more models"))
            return sum(int(m[1]) for m in found if m)

        await wait_for(
            lambda: len(lines("joined (")) + counted() == burst, message="every join told"
        )
        assert len(lines("joined (")) <= 2 * JOIN_LINES  # (the burst may span two seconds)
    finally:
        await watcher.stop()


async def test_a_first_load_whose_fetches_outlast_the_window_says_so(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fetches still in flight when the quiet window ends: joins are named again, and the
    line says the metadata is still fetching, not that it is fetched."""
    caplog.set_level(logging.INFO, logger="shoal.frontend.registry.registrations")
    watcher = ModelWatcher(
        Discovery(store), Registry(), MetadataCache(tmp_path / "cache"), FrontendMetrics()
    )
    watcher.no_fetches.clear()
    watcher.fetching = 1  # (a fetch of the first load that does not end)
    loaded = asyncio.Event()
    loaded.set()
    await watcher._quiet_while_loading(loaded, 0.05)
    assert not watcher.quiet_joins
    lines = [r.getMessage() for r in caplog.records if "first load" in r.getMessage()]
    assert len(lines) == 1 and "still fetching after 0.05s" in lines[0], lines


@pytest.mark.parametrize("backend", ["memory"])
async def test_the_streams_of_thousands_of_namespaces_start_a_slice_per_loop_turn(
    store: Store, tmp_path: Path
) -> None:
    """A frontend of 3,000 namespaces started a stream for each at once after its first
    listing: every first step ran in one turn of the event loop (305 ms on etcd). They
    start `START_SLICE` at a time."""
    namespaces = [f"ns{i}" for i in range(1000)]
    cache = MetadataCache(tmp_path / "cache")
    watcher = ModelWatcher(Discovery(store), Registry(), cache, FrontendMetrics(), namespaces)
    turns = LoopTurns().wrap(watcher.discovery, "list_and_watch")
    try:
        await watcher.start()
        await wait_for(lambda: turns.on_loop == len(namespaces), message="every stream started")
    finally:
        await turns.stop()
        await watcher.stop()
    assert turns.most_per_turn <= START_SLICE
