"""Streams that cannot migrate end as before: the SSE error event after the text received,
and `shoal_frontend_migrations_total{outcome="refused"}` names why."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from shoal.cards import WorkerRole
from shoal.frontend import Frontend
from shoal.frontend.proxy.migration import CARD_KEY, limit_of
from shoal.frontend.registry.registry import Registry
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import FakeWorker, serving
from tests.frontend.test_disagg_registry import instance
from tests.helpers import wait_for

CHAT = [{"role": "user", "content": "hi"}]
TOOL_CALL = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}]


async def _stream(frontend: Frontend, **extra: Any) -> bytes:
    body = {"model": "mock-llm", "messages": CHAT, "stream": True, **extra}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 200
        return await response.read()


def _refused(frontend: Frontend, reason: str) -> float:
    value = frontend.metrics.registry.get_sample_value(
        "shoal_frontend_migrations_total", {"outcome": "refused", "reason": reason}
    )
    return value or 0.0


@pytest.mark.parametrize(
    ("reason", "workers", "request_extra", "worker_setup", "frontend_settings"),
    [
        ("n", 2, {"n": 2}, {}, {}),
        ("logprobs", 2, {"logprobs": True}, {}, {}),
        ("tool_calls", 2, {}, {"delta_extra": {"tool_calls": TOOL_CALL}}, {}),
        ("card", 2, {}, {"runtime_config": {"migration_limit": 0}}, {}),
        ("no_instance", 1, {}, {}, {}),
        ("disabled", 2, {}, {}, {"migration_limit": 0}),
    ],
)
async def test_a_stream_that_cannot_migrate_ends_with_the_error_event_and_says_why(
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    store: Store,
    reason: str,
    workers: int,
    request_extra: dict[str, Any],
    worker_setup: dict[str, Any],
    frontend_settings: dict[str, Any],
) -> None:
    fleet: list[FakeWorker] = []
    for _ in range(workers):
        worker = await start_worker(register=False)
        worker.stream_chunks, worker.die_after_chunks = 4, 2  # wherever it goes, it dies
        for name, value in worker_setup.items():
            setattr(worker, name, value)
        await worker.register(store)
        fleet.append(worker)
    frontend = await start_frontend(**frontend_settings)
    await wait_for(lambda: serving(frontend, "mock-llm", workers), message="model served")
    received = await _stream(frontend, **request_extra)
    events = received.split(b"\n\n")
    assert events[0].startswith(b"data: ") and b"hello from" in events[0]
    assert b"failed while streaming" in events[2]
    assert sum(w.requests for w in fleet) == 1  # not sent anywhere else
    assert _refused(frontend, reason) == 1


@pytest.mark.parametrize(
    ("card", "flag", "limit"),
    [({}, 1, 1), ({"migration_limit": 3}, 1, 3), ({"migration_limit": 3}, 0, 0), ({}, 2, 2)],
)
def test_a_card_sets_its_own_migration_limit_and_the_flag_at_zero_wins(
    card: dict[str, Any], flag: int, limit: int
) -> None:
    worker = FakeWorker()
    worker.instance_id, worker.runtime_config = 7, card
    registry = Registry()
    registry.join(worker.model_instance())
    assert limit_of(registry.models["mock-llm"], flag) == limit


def test_a_disaggregated_models_decode_card_sets_its_migration_limit() -> None:
    """A decode stage streams the answer, so its card's `migration_limit` holds for it (an
    engine that cannot continue text says 0, and no stream of it is continued)."""
    registry = Registry()
    registry.join(instance(1, WorkerRole.PREFILL, component="prefill"))
    registry.join(instance(2, WorkerRole.DECODE, component="decode", config={CARD_KEY: 0}))
    model = registry.models["m"]
    assert model.stages is not None
    assert limit_of(model, 3) == 0
