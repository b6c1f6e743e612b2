"""Frontends fail under load: one restarted beside a second one over the same store, and
discovery listings that fail during reconciliation."""

from __future__ import annotations

import signal
from pathlib import Path

from shoal.frontend import Frontend, FrontendConfig
from tests.faults.conftest import Fleet
from tests.faults.support import RECONCILE_INTERVAL, Load, Row, routes_exactly, until
from tests.faults.support import instance_ids as routed
from tests.frontend.support import FilteringDiscovery
from tests.helpers import free_port

COMMAND = "pytest tests/faults/test_frontend_faults.py"


async def test_frontend_restarted_under_load_beside_a_second_one_fails_nothing(
    fleet: Fleet, backend: str
) -> None:
    workers = [await fleet.worker() for _ in range(2)]
    ids = {w.instance_id for w in workers}
    port = free_port()
    first, second = await fleet.frontend(port=port), await fleet.frontend()
    for front in (first, second):
        await until(lambda f=front: routes_exactly(f.url, ids), 15, "both workers routed")
    load = Load([first.url, second.url])
    load.start()
    try:
        await load.advance(40)
        first.signal(signal.SIGTERM)
        assert await first.wait(20) == 0
        await load.advance(40)  # all on the second frontend now
        restarted = await fleet.frontend(port=port)
        converge = await until(
            lambda: routes_exactly(restarted.url, ids), 15, "restarted one serves"
        )
        await load.advance(40)
    finally:
        await load.finish()
    Row(
        "a frontend SIGTERMed and restarted under load, a second one beside it; clients "
        "retry a refused connection at the other",
        backend, load.sent, len(load.failed_before_first_byte), len(load.failed_mid_stream),
        round(converge, 2), 0, COMMAND,
    ).record()  # fmt: skip
    assert load.failed_before_first_byte == []
    assert load.failed_mid_stream == []


async def test_failing_discovery_listings_change_nothing_and_are_repaired_after(
    fleet: Fleet, store_url: str, namespace: str, tmp_path: Path, backend: str
) -> None:
    from shoal.store import open_store

    store = await open_store(store_url)
    discovery = FilteringDiscovery(store)
    frontend = Frontend(
        FrontendConfig(
            port=0, namespaces=(namespace,), reconcile_interval=RECONCILE_INTERVAL,
            cache_dir=tmp_path / "cache", first_byte_timeout=1, inhibit_seconds=3,
        ),
        discovery=discovery,
    )  # fmt: skip
    await frontend.start()
    try:
        workers = [await fleet.worker() for _ in range(2)]
        ids = {w.instance_id for w in workers}
        await until(lambda: routes_exactly(frontend.url, ids), 15, "both workers routed")
        load = Load([frontend.url])
        load.start()
        try:
            await load.advance(20)
            before = _sample(frontend, "shoal_frontend_reconcile_failures_total", stage="list")
            discovery.list_failures = 1_000  # every listing fails from now on
            await until(
                lambda: (
                    _sample(frontend, "shoal_frontend_reconcile_failures_total", stage="list")
                    >= before + 2
                ),
                10,
                "failed passes",
            )
            # A worker leaving meanwhile is removed by its events, listings or not.
            workers[0].signal(signal.SIGTERM)
            await until(
                lambda: routes_exactly(frontend.url, {workers[1].instance_id}), 10, "removed"
            )
            await load.advance(20)
            discovery.list_failures = 0
            passes = _sample(frontend, "shoal_frontend_reconcile_runs_total")
            converge = await until(
                lambda: _sample(frontend, "shoal_frontend_reconcile_runs_total") > passes + 1,
                RECONCILE_INTERVAL * 5,
                "reconciliation passes again",
            )
            await load.advance(20)
        finally:
            await load.finish()
        assert await routed(frontend.url) == {workers[1].instance_id}
    finally:
        await frontend.stop()
        await store.close()
    Row(
        "every discovery listing fails for several reconciliation passes; a worker drains "
        "meanwhile",
        backend, load.sent, len(load.failed_before_first_byte), len(load.failed_mid_stream),
        round(converge, 2), 0, COMMAND,
    ).record()  # fmt: skip
    assert load.failed_before_first_byte == []
    assert load.failed_mid_stream == []


def _sample(frontend: Frontend, name: str, **labels: str) -> float:
    return frontend.metrics.registry.get_sample_value(name, labels) or 0.0
