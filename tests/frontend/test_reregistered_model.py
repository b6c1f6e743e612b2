"""A worker that swaps the model it serves at the same discovery key (detach, then attach:
`Endpoint.sync_models`) is served under its new name, and only that, for good."""

from __future__ import annotations

import pytest

from shoal.frontend import Frontend
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import FilteringDiscovery, serving
from tests.frontend.test_watcher import listed_models
from tests.helpers import wait_for

INTERVAL = 0.4  # the reconcile interval of this test


@pytest.fixture(params=["memory", "sqlite", "etcd"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def passes(frontend: Frontend) -> float:
    value = frontend.metrics.registry.get_sample_value(
        "shoal_frontend_reconcile_duration_seconds_count"
    )
    return value or 0.0


async def test_a_model_re_registered_at_its_key_is_served_under_the_new_name_only(
    discovery: FilteringDiscovery, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker("llama")
    frontend = await start_frontend(reconcile_interval=INTERVAL)
    await wait_for(lambda: serving(frontend, "llama"))
    await wait_for(lambda: passes(frontend) >= 1, message="a pass listed llama")
    assert worker.discovery is not None and worker.lease is not None
    await worker.discovery.unregister_model(worker.key)
    worker.model = "mistral"
    await worker.discovery.register_model(worker.key, worker.card(), lease=worker.lease.id)
    await wait_for(lambda: serving(frontend, "mistral"), timeout=INTERVAL * 2 + 5)
    seen = passes(frontend)
    await wait_for(lambda: passes(frontend) >= seen + 2, message="two passes after the swap")
    assert "llama" not in frontend.registry.models
    assert await listed_models(frontend) == ["mistral"]
