"""`/health` and the `/ui` dashboard over a fleet larger than a report should list: bounded
answers that count everything, the most severe items first, and reads that let the event
loop run (the fleet is joined straight into the registry: the reports read only that)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from shoal.cards import ModelCard, slugify
from shoal.discovery import InstanceInfo, ModelInstance, ModelKey
from shoal.frontend import Frontend
from shoal.frontend import endpoints as frontend_endpoints
from shoal.frontend.dashboard import dashboard, snapshot
from tests.frontend.conftest import StartFrontend

FIRST_ID = 0x10000


def card(name: str) -> ModelCard:
    return ModelCard.build(
        display_name=name,
        slug=slugify(name),
        source=f"test://{name}",
        model_types=["chat"],
        context_length=4096,
    )


def join(
    frontend: Frontend, instance_id: int, model: ModelCard, taints: tuple[str, ...] = ()
) -> None:
    info = InstanceInfo("fleet", "backend", "generate", instance_id, "http://127.0.0.1:9/v1", "")
    if taints:
        model = model.with_taints(taints)
    frontend.registry.join(ModelInstance(ModelKey(info.endpoint_id, instance_id), model, info))


async def get_json(url: str) -> tuple[int, dict[str, Any], int]:
    async with aiohttp.ClientSession() as session:
        response = await session.get(url)
        body = await response.read()
        return response.status, await response.json(), len(body)


async def test_health_lists_a_bounded_part_of_a_large_fleet_the_models_not_serving_first_and_counts_all(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frontend_endpoints, "HEALTH_MODELS", 10)
    frontend = await start_frontend(reconcile_interval=3600)
    models = [card(f"m-{i:03}") for i in range(40)]
    iid = FIRST_ID
    for model in models[:39]:
        for _ in range(30):  # 30 routable instances a model: more than a report names
            join(frontend, iid, model)
            iid += 1
    last = models[39]  # sorts last, but is not serving: every instance of it drains
    join(frontend, iid, last, taints=("draining",))

    status, body, size = await get_json(f"{frontend.url}/health")
    assert status == 200
    assert (body["models_total"], body["models_not_serving"]) == (40, 1)
    assert body["instances"] == 39 * 30  # the draining one is not routable
    assert len(body["models"]) == 10
    assert "m-039" in body["models"] and not body["models"]["m-039"]["serving"]
    assert sorted(body["models"]) == ["m-000", *[f"m-{i:03}" for i in range(1, 9)], "m-039"]
    (worker_set,) = body["models"]["m-000"]["worker_sets"]
    assert (worker_set["routable"], worker_set["members"]) == (30, 30)
    assert worker_set["instances"] == [f"{FIRST_ID + i:x}" for i in range(20)]  # the 20 smallest
    assert size < 16_000

    join(frontend, iid + 1, models[0])  # a change: the next answer is read again
    _, body, _ = await get_json(f"{frontend.url}/health")
    assert body["instances"] == 39 * 30 + 1
    assert body["models"]["m-000"]["worker_sets"][0]["routable"] == 31


async def test_dashboard_shows_the_most_severe_rows_of_a_large_fleet_and_counts_every_state(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "MAX_ROWS", 50)
    frontend = await start_frontend(reconcile_interval=3600)
    models = [card(f"m-{i:03}") for i in range(80)]
    for i in range(400):
        join(frontend, FIRST_ID + i, models[i % 79])
    draining = [FIRST_ID + 400 + i for i in range(5)]
    for iid in draining:  # the last model: served by draining instances only
        join(frontend, iid, models[79], taints=("draining",))
    inhibited = [FIRST_ID + 390 + i for i in range(3)]  # sort after the first 50 ready ones
    for iid in inhibited:
        member = frontend.registry.member(
            ModelKey(InstanceInfo("fleet", "backend", "generate", iid, "", "").endpoint_id, iid)
        )
        assert member is not None
        member.upstream.inhibit(60)

    status, body, _ = await get_json(f"{frontend.url}/ui/api/snapshot")
    assert status == 200
    totals = body["totals"]
    assert totals["instances"] == 405 and totals["rows_max"] == 50
    assert totals["by_state"] == {
        "draining": 5,
        "tainted": 0,
        "refused": 0,
        "pending": 0,
        "inhibited": 3,
        "ready": 397,
    }
    assert (totals["models"], totals["models_not_serving"]) == (80, 1)
    rows = {row["instance_id"]: row["state"] for row in body["instances"]}
    assert len(rows) == 50
    assert all(rows[f"{iid:x}"] == "draining" for iid in draining)
    assert all(rows[f"{iid:x}"] == "inhibited" for iid in inhibited)
    ready = sorted(key for key, state in rows.items() if state == "ready")
    assert ready == [f"{FIRST_ID + i:x}" for i in range(42)]  # the rest: the first by key
    names = [model["name"] for model in body["models"]]
    assert len(names) == 50 and "m-079" in names  # not serving: shown though it sorts last


async def test_a_read_of_a_large_fleet_lets_the_event_loop_run_between_slices(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "SLICE", 100)
    frontend = await start_frontend(reconcile_interval=3600)
    model = card("m")
    for i in range(3000):
        join(frontend, FIRST_ID + i, model)
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count_turns())
    try:
        await asyncio.sleep(0)
        before = turns
        sections = await frontend.dashboard.reader.read()
        during = turns - before
    finally:
        counter.cancel()
    assert len(sections["instances"]) == snapshot.MAX_ROWS
    assert during >= 3000 // 100  # the loop ran at least once every slice of 100
    assert frontend.dashboard.reader.busy > 0


async def test_reads_asked_at_once_share_one_read_of_the_fleet(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "SLICE", 100)
    monkeypatch.setattr(dashboard, "SPACED_FROM", float("inf"))  # (spacing: test_..._edges)
    frontend = await start_frontend(reconcile_interval=3600)
    for i in range(1000):
        join(frontend, FIRST_ID + i, card("m"))
    reader = frontend.dashboard.reader
    calls = 0
    read = reader.read

    async def counted() -> snapshot.Sections:
        nonlocal calls
        calls += 1
        return await read()

    monkeypatch.setattr(reader, "read", counted)
    results = await asyncio.gather(*(frontend.dashboard.read() for _ in range(5)))
    assert calls == 1
    assert all(result is results[0] for result in results)
    await frontend.dashboard.read()  # a read asked after is a new one
    assert calls == 2


async def test_a_snapshot_asked_by_a_client_that_leaves_cancels_nothing_shared(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "SLICE", 50)
    frontend = await start_frontend(reconcile_interval=3600)
    for i in range(2000):
        join(frontend, FIRST_ID + i, card("m"))
    _reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    writer.write(b"GET /ui/api/snapshot HTTP/1.1\r\nhost: x\r\n\r\n")
    await writer.drain()
    writer.close()  # gone before its answer: the read it started goes on for the others
    status, body, _ = await get_json(f"{frontend.url}/ui/api/snapshot")
    assert status == 200 and body["totals"]["instances"] == 2000
