"""What a pass leaves to Python's garbage collector: full collections over a pass's listings
(over 100,000 objects at 10,000 models) found next to nothing and held the catalog's event
loop 50-300 ms each. With `PassCollections` none starts during a pass; one runs after it."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from shoal.catalog import CatalogServer
from shoal.catalog.collector import PassCollections
from tests.catalog.controller_fixtures import WS, controller_on, seed_converged


@pytest.fixture(autouse=True)
def _collector_as_it_was() -> Iterator[None]:
    """What a test froze goes back to the collector, and its thresholds as they were."""
    saved = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*saved)


async def test_no_full_collection_runs_during_a_pass_and_one_runs_after_it(
    catalog: CatalogServer, database_url: str
) -> None:
    await seed_converged(database_url, {"p": [f"m{i:04d}" for i in range(2000)]})
    full: list[bool] = []  # each full collection that started: during a pass?
    in_pass = [False]

    def watch(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(in_pass[0])

    async with controller_on(catalog.url, workspaces=[WS]) as (ctl, _, _store):
        ctl.collections = collections = PassCollections()
        run_pass = ctl._pass

        async def a_pass() -> None:
            in_pass[0] = True
            try:
                await run_pass()
            finally:
                in_pass[0] = False

        ctl._pass = a_pass  # type: ignore[method-assign]
        gc.freeze()  # the session's heap out of the way: full collections come often
        gc.collect()
        gc.set_threshold(100, 2, 2)
        gc.callbacks.append(watch)
        try:
            for _ in range(2):
                await ctl.step()
        finally:
            gc.callbacks.remove(watch)
        assert gc.get_threshold() == (100, 2, 2)  # put back after each pass
    assert ctl.passes == 2 and ctl.last is not None and ctl.last.failed == {}
    assert full.count(False) >= 2 and True not in full  # after each pass, never during one
    assert collections.collections == 2 and collections.frozen


async def test_a_failed_pass_puts_the_thresholds_back_and_collects_nothing(
    catalog: CatalogServer,
) -> None:
    async with controller_on(catalog.url, workspaces=[WS]) as (ctl, client, _store):
        ctl.collections = collections = PassCollections()
        client.fail = lambda call: True  # every workspace fails: the pass raises
        saved = gc.get_threshold()
        with pytest.raises(Exception, match="failed"):
            await ctl.step()
        assert gc.get_threshold() == saved
        assert collections.collections == 0 and not collections.frozen


async def test_passes_that_overlap_in_one_process_leave_the_thresholds_as_they_were() -> None:
    """What was wrong: each holder saved the thresholds it found and put them back when it
    ended. Two controllers' passes in one process (or a pass beside a frontend's load, which
    lifts the same threshold), ending in the order they began, left the second's saved copy,
    the lifted one, in force: no full collection ever again, cyclic garbage kept for the
    life of the process. What holds now: the last holder to end puts back what the first
    one found, whatever the order."""
    import asyncio

    from shoal.frontend.registry.freeze import freeze_while_loading

    saved = (700, 10, 10)
    gc.set_threshold(*saved)
    first, second = PassCollections(), PassCollections()
    for order in ("first ends first", "second ends first"):
        a, b = first.deferred(), second.deferred()
        a.__enter__()
        b.__enter__()
        assert gc.get_threshold()[2] > 10**6
        for ending in (a, b) if order == "first ends first" else (b, a):
            ending.__exit__(None, None, None)
        assert gc.get_threshold() == saved, order

    loaded, fetched = asyncio.Event(), asyncio.Event()
    with first.deferred():
        loading = asyncio.create_task(freeze_while_loading(loaded, fetched))
        await asyncio.sleep(0)  # (the load lifts the threshold after the pass did)
    assert gc.get_threshold()[2] > 10**6  # the load goes on: still deferred
    loaded.set(), fetched.set()
    await loading
    assert gc.get_threshold() == saved
