"""A frontend over a fleet larger than it can load within its setup timeout."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from shoal.discovery import Discovery, InstanceInfo, ModelInstance, ModelKey
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.registry import watcher
from shoal.frontend.registry.registry import WorkerSet
from shoal.store import Store, StoreUnavailableError
from tests.frontend.conftest import StartWorker
from tests.frontend.support import FilteringDiscovery

FLEET = 256
JOIN_SECONDS = 0.004  # each join holds the loop this long: the fleet loads in ~1 s
SETUP_TIMEOUT = 0.3


class SlowJoins:
    """A registry observer that makes every join slow, as a large fleet's are in total; it
    notes the frontend's `/health` when half the fleet has joined."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.joins = 0
        self.health_half_way: tuple[int, dict[str, Any]] | None = None

    def joined(self, model: ModelInstance, ws: WorkerSet) -> None:
        time.sleep(JOIN_SECONDS)  # a slow join holds the loop: what is under test, not a wait
        self.joins += 1
        if self.joins == FLEET // 2:
            self.health_half_way = self.frontend.health()

    def left(self, key: ModelKey, ws: WorkerSet) -> None:
        pass


async def register_fleet(store: Store, url: str, card_of: Any) -> None:
    discovery = Discovery(store)
    for i in range(FLEET):
        iid = 0x1000 + i
        info = InstanceInfo("default", "backend", "generate", iid, f"{url}/v1", url)
        await discovery.register_instance(info, lease=0)
        await discovery.register_model(ModelKey(info.endpoint_id, iid), card_of, lease=0)


async def test_the_setup_timeout_bounds_the_stores_answer_not_the_time_to_load_the_fleet(
    start_worker: StartWorker,
    store: Store,
    discovery: FilteringDiscovery,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = await start_worker(register=False)
    # No metadata files: each card joins as soon as it is registered (no fetch first).
    card = msgspec.structs.replace(worker.card(), metadata_files={})
    await register_fleet(store, worker.url, card)
    monkeypatch.setattr(watcher, "PROGRESS_INTERVAL", 0.05)
    caplog.set_level(logging.INFO, logger="shoal.frontend.registry.watcher")
    frontend = Frontend(
        FrontendConfig(
            port=0,
            cache_dir=tmp_path / "cache",
            setup_timeout=SETUP_TIMEOUT,
            reconcile_interval=3600,
        ),
        discovery=discovery,
    )
    slow = SlowJoins(frontend)
    frontend.registry.observers.append(slow)
    started = time.monotonic()
    try:
        await frontend.start()  # the store answers at once; the fleet takes ~1 s to join
        took = time.monotonic() - started
        assert took > SETUP_TIMEOUT, took  # (else this test proves nothing)
        assert len(frontend.registry) == FLEET
        assert frontend.health()[0] == 200
        assert frontend.readiness()[0] == 200
        # Half-way, the frontend said it was starting, and how far it got.
        assert slow.health_half_way is not None
        status, body = slow.health_half_way
        assert status == 503 and body["status"] == "starting", body
        assert body["loading"]["joined"] == FLEET // 2, body
        messages = [r.getMessage() for r in caplog.records]
        progress = [m for m in messages if m.startswith("loading discovery: ")]
        assert progress, "no progress line while loading"
        loaded = f"discovery loaded: {FLEET} of {FLEET} model instances registered, {FLEET} joined"
        assert loaded in messages, progress
    finally:
        await frontend.stop()


async def test_a_store_that_never_answers_still_fails_the_start_within_the_setup_timeout(
    store: Store, discovery: FilteringDiscovery, tmp_path: Path
) -> None:
    never = asyncio.Event()

    async def no_answer(prefixes: Any, *args: Any, **kwargs: Any) -> Any:
        await never.wait()

    discovery.store = _Silent(store, no_answer)  # type: ignore[assignment]
    frontend = Frontend(
        FrontendConfig(port=0, cache_dir=tmp_path / "cache", setup_timeout=SETUP_TIMEOUT),
        discovery=discovery,
    )
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailableError, match=r"did not answer within 0\.3s"):
            await frontend.start()
        assert time.monotonic() - started < 5
    finally:
        await frontend.stop()


class _Silent:
    """A store whose listings never answer; everything else passes through."""

    def __init__(self, store: Store, get_prefixes: Any) -> None:
        self._store = store
        self.get_prefixes = self.get_prefixes_changed = get_prefixes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


BUSY_LISTING = 1.0  # how long the store stays busy with each listing after answering it


class _OneThread:
    """A store that serves one call at a time, busy `BUSY_LISTING` s with every listing of
    the fleet after it answered (it answers the frontend's wait at once): SQLite's one
    thread reading 200,000 keys while the loop parses what came first (the watch streams
    listed the fleet once more then)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._turn = asyncio.Lock()
        self.listings = 0

    async def _listing(self, name: str, *args: Any, **kwargs: Any) -> Any:
        async with self._turn:
            answer = await getattr(self._store, name)(*args, **kwargs)
            self.listings += 1
            await asyncio.sleep(BUSY_LISTING)  # (the store's thread at work, not a wait)
            return answer

    async def get_prefixes(self, *args: Any, **kwargs: Any) -> Any:
        return await self._listing("get_prefixes", *args, **kwargs)

    async def get_prefixes_changed(self, *args: Any, **kwargs: Any) -> Any:
        return await self._listing("get_prefixes_changed", *args, **kwargs)

    async def get_prefix(self, *args: Any, **kwargs: Any) -> Any:
        async with self._turn:
            return await self._store.get_prefix(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def test_the_routes_are_read_before_the_fleets_listings_keep_the_store_busy(
    start_worker: StartWorker, store: Store, discovery: FilteringDiscovery, tmp_path: Path
) -> None:
    worker = await start_worker(register=False)
    card = msgspec.structs.replace(worker.card(), metadata_files={})
    await register_fleet(store, worker.url, card)
    busy = _OneThread(store)
    discovery.store = busy  # type: ignore[assignment]
    config = FrontendConfig(
        port=0,
        cache_dir=tmp_path / "cache",
        setup_timeout=BUSY_LISTING / 2,
        reconcile_interval=3600,
    )
    frontend = Frontend(config, discovery=discovery)
    try:
        # The store answers every call within the setup timeout; only its listings keep it
        # busy longer, and reading the routes must not wait behind them.
        await frontend.start()
        assert busy.listings >= 1  # (else this test proves nothing)
        assert len(frontend.registry) == FLEET
        assert frontend.route_watcher is not None and frontend.route_watcher.loaded.is_set()
    finally:
        await frontend.stop()
