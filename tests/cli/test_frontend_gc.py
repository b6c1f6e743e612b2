"""A frontend process's collector during a cold start: full collections paused while the
fleet loads, what is loaded frozen once no metadata fetch is in flight, then as before."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace
from typing import Any, cast

from shoal.cli.frontend import freeze_once_loaded, pause_full_collections
from tests.helpers import wait_for


async def test_full_collections_pause_while_loading_and_the_loaded_fleet_is_frozen_after() -> None:
    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    no_fetches = asyncio.Event()  # a fetch is in flight
    frontend = cast(Any, SimpleNamespace(watcher=SimpleNamespace(no_fetches=no_fetches)))
    try:
        thresholds = pause_full_collections()
        assert thresholds == before
        assert gc.get_threshold()[2] > 10**6  # no full collection while loading
        freezing = asyncio.create_task(freeze_once_loaded(frontend, thresholds))
        await asyncio.sleep(0)
        assert not freezing.done() and gc.get_freeze_count() == frozen_before
        loaded = [object() for _ in range(10)]  # (what the fleet's load left alive)
        no_fetches.set()
        await wait_for(freezing.done, timeout=5)
        assert gc.get_freeze_count() > frozen_before
        assert gc.get_threshold() == before  # collections as before, over what came later
        assert loaded
    finally:
        gc.unfreeze()  # (the test session's objects go back to the collector)
        gc.set_threshold(*before)


async def test_a_stop_while_loading_restores_the_collector() -> None:
    before = gc.get_threshold()
    frontend = cast(Any, SimpleNamespace(watcher=SimpleNamespace(no_fetches=asyncio.Event())))
    try:
        freezing = asyncio.create_task(freeze_once_loaded(frontend, pause_full_collections()))
        await asyncio.sleep(0)
        freezing.cancel()
        await asyncio.gather(freezing, return_exceptions=True)
        assert gc.get_threshold() == before
    finally:
        gc.set_threshold(*before)
