"""Convergence paths of the watcher that no other test pins down: what reconciliation repairs
when the registry drifted behind the watcher's back, what a converged pass costs (nothing),
and a discovery stream that ends."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from shoal.discovery import DiscoveryEvent, Query
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.registry import watcher as watcher_module
from shoal.frontend.registry.watcher import APPLY_BATCH, ModelWatcher
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import FilteringDiscovery, serving
from tests.helpers import wait_for
from tests.membership.support import add_endpoint


def watcher_of(frontend: Frontend) -> ModelWatcher:
    assert frontend.watcher is not None
    return frontend.watcher


async def test_a_member_dropped_behind_the_watchers_back_is_rejoined_by_the_next_pass(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=60)
    await start_worker()
    await wait_for(lambda: serving(frontend))
    watcher = watcher_of(frontend)
    [key] = list(watcher.registrations)
    frontend.registry.leave(key)  # the registry forgot it; the watcher still holds it
    assert not serving(frontend)
    assert await watcher.reconcile() == Counter({"rejoin": 1})
    assert serving(frontend)


async def test_a_registration_whose_instance_no_longer_matches_is_registered_again(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=60)
    worker = await start_worker()
    await wait_for(lambda: serving(frontend))
    watcher = watcher_of(frontend)
    [key] = list(watcher.registrations)
    registration = watcher.registrations[key]
    stale = msgspec.structs.replace(registration.model.instance, url="http://127.0.0.1:9/v1")
    registration.model = dataclasses.replace(registration.model, instance=stale)
    assert await watcher.reconcile() == Counter({"reregister": 1})
    assert watcher.registrations[key].model.instance.url == f"{worker.url}/v1"
    await wait_for(lambda: serving(frontend))


async def test_a_converged_pass_changes_nothing_and_invalidates_nothing(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=60)
    await start_worker("a")
    await start_worker("b")
    await wait_for(lambda: serving(frontend, "a") and serving(frontend, "b"))
    watcher = watcher_of(frontend)
    await watcher.reconcile()
    version = frontend.registry.version
    for _ in range(3):
        assert await watcher.reconcile() == Counter()
    assert frontend.registry.version == version  # cached /v1/models stays valid


class CountingDiscovery(FilteringDiscovery):
    """Counts the watch streams opened; with `end_after`, the first stream ends after that
    many events (as when the store closes it), so the watcher must open another."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.streams = 0
        self.end_after: int | None = None

    async def list_and_watch(
        self, query: Query | None = None, *, after_listing: bool = False
    ) -> AsyncIterator[DiscoveryEvent]:
        self.streams += 1
        first = self.streams == 1
        seen = 0
        async for event in super().list_and_watch(query, after_listing=after_listing):
            yield event
            seen += 1
            if first and self.end_after is not None and seen >= self.end_after:
                return


async def test_a_pass_lists_each_scope_once_and_opens_no_watch(
    start_worker: StartWorker, store: Store, tmp_path: Path
) -> None:
    discovery = CountingDiscovery(store)
    frontend = Frontend(config(tmp_path), discovery=discovery)
    await frontend.start()
    try:
        await start_worker()
        await wait_for(lambda: serving(frontend))
        streams, lists = discovery.streams, discovery.list_calls
        await watcher_of(frontend).reconcile()
        assert discovery.list_calls == lists + 1  # one listing for the one scope
        assert discovery.streams == streams  # and no watch opened
    finally:
        await frontend.stop()


async def test_a_long_pass_beats_the_heartbeat_as_it_goes(
    discovery: FilteringDiscovery, start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass over thousands of entries stays healthy: it beats after every batch of
    entries it went through (`APPLY_BATCH` checked one by one, a `SETTLED_SLICE` of those
    found settled in C loops; the slice is made as small as a batch here), not once at its
    end."""
    monkeypatch.setattr(watcher_module, "SETTLED_SLICE", APPLY_BATCH)
    frontend = await start_frontend(reconcile_interval=60)
    entries = 4 * APPLY_BATCH + 1
    for i in range(entries):
        await add_endpoint(discovery, "default", 0x100 + i, model=f"m{i % 7}")
    await wait_for(lambda: len(frontend.registry) == entries, message="every card joined")
    beats = 0

    def beat() -> None:
        nonlocal beats
        beats += 1

    assert await watcher_of(frontend).reconcile(emit_heartbeat=beat) == Counter()
    assert beats >= entries // APPLY_BATCH + 1


async def test_a_watch_stream_that_ends_is_restarted_and_misses_nothing(
    start_worker: StartWorker, store: Store, tmp_path: Path
) -> None:
    discovery = CountingDiscovery(store)
    discovery.end_after = 1
    frontend = Frontend(config(tmp_path), discovery=discovery)
    await frontend.start()
    try:
        await start_worker("first")
        await wait_for(lambda: discovery.streams >= 2, message="the stream was restarted")
        await start_worker("second")
        await wait_for(lambda: serving(frontend, "first") and serving(frontend, "second"))
    finally:
        await frontend.stop()


def config(tmp_path: Path) -> FrontendConfig:
    return FrontendConfig(port=0, reconcile_interval=60, drain_timeout=1, cache_dir=tmp_path / "c")
