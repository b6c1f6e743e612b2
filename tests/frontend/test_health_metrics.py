"""`/live`, `/health`, `/health/controllers` and `/metrics`."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from shoal.discovery import ModelKey
from shoal.frontend import Frontend, FrontendConfig
from shoal.store import Store
from tests.etcd_server import EtcdServer
from tests.frontend.conftest import StartFrontend, StartWorker, openai_client
from tests.frontend.support import FilteringDiscovery, serving
from tests.helpers import wait_for
from tests.processes import shoal

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


async def get(url: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as session:
        response = await session.get(url)
        return response.status, await response.json()


async def test_health_is_503_until_the_first_snapshot_then_lists_what_it_knows(
    discovery: FilteringDiscovery, start_worker: StartWorker, tmp_path: Path
) -> None:
    worker = await start_worker()
    discovery.list_failures = 3  # the store is not answering yet
    frontend = Frontend(
        FrontendConfig(port=0, cache_dir=tmp_path / "c"),
        discovery=discovery,  # type: ignore[operator]
    )
    starting = asyncio.create_task(frontend.start())
    try:
        await wait_for(lambda: frontend.server is not None and discovery.list_calls >= 1)
        status, body = await get(f"{frontend.url}/health")
        assert (status, body["status"]) == (503, "starting"), body
        assert body["loading"]["listed"] is None  # (the listing has not answered)
        assert (await get(f"{frontend.url}/live"))[0] == 200
        await starting
        await wait_for(lambda: serving(frontend))
        status, body = await get(f"{frontend.url}/health")
        assert status == 200
        assert body["models"]["mock-llm"]["instances"] == 1
        assert body["models"]["mock-llm"]["worker_sets"][0]["instances"] == [
            f"{worker.instance_id:x}"
        ]
        assert body["instances"] == 1
    finally:
        await frontend.stop()


async def test_draining_frontend_answers_503_on_live_and_health(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend()
    frontend.draining = True
    assert (await get(f"{frontend.url}/health")) == (503, {"status": "draining"})
    assert (await get(f"{frontend.url}/live"))[0] == 503
    frontend.draining = False


async def test_health_controllers_reports_the_reconciliation_loop(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(reconcile_interval=0.2)
    status, body = await get(f"{frontend.url}/health/controllers")
    assert (status, body) == (200, {"status": "ok", "unhealthy": {}})
    assert list(frontend.manager.loops) == ["model-reconciler"]


async def test_metrics_count_requests_latency_retries_and_instances(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    bad, _good = await start_worker(), await start_worker()
    bad.fail_next = 1
    frontend = await start_frontend(reconcile_interval=0.2)
    await wait_for(lambda: serving(frontend, instances=2))
    client = openai_client(frontend)
    for _ in range(2):
        await client.chat.completions.create(model="mock-llm", messages=CHAT)
    stream = await client.chat.completions.create(model="mock-llm", messages=CHAT, stream=True)
    _ = [c async for c in stream]
    with contextlib.suppress(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=CHAT)
    await wait_for(lambda: frontend.metrics.reconcile_runs._value.get() >= 2)
    async with aiohttp.ClientSession() as session:
        response = await session.get(f"{frontend.url}/metrics")
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    registry = frontend.metrics.registry
    assert (
        registry.get_sample_value(
            "shoal_frontend_requests_total", {"model": "mock-llm", "status": "200"}
        )
        == 3
    )
    assert (
        registry.get_sample_value(
            "shoal_frontend_requests_total", {"model": "_unknown", "status": "404"}
        )
        == 1
    )
    assert registry.get_sample_value("shoal_frontend_retries_total", {"model": "mock-llm"}) in (
        0,
        1,
    )
    assert registry.get_sample_value("shoal_frontend_inflight_requests", {"model": "mock-llm"}) == 0
    assert registry.get_sample_value("shoal_frontend_live_instances", {"model": "mock-llm"}) == 2
    assert (
        registry.get_sample_value(
            "shoal_frontend_time_to_first_token_seconds_count", {"model": "mock-llm"}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "shoal_frontend_request_duration_seconds_count", {"model": "mock-llm"}
        )
        == 3
    )
    assert (registry.get_sample_value("shoal_frontend_reconcile_runs_total") or 0) >= 2
    for name in (
        "shoal_frontend_reconcile_repairs_total",
        "shoal_frontend_reconcile_failures_total",
        "shoal_frontend_cards_refused_total",
        "shoal_frontend_instances_inhibited_total",
    ):
        assert f"# TYPE {name} counter" in text


async def test_each_frontend_has_its_own_metrics_registry(start_frontend: StartFrontend) -> None:
    one, two = await start_frontend(), await start_frontend()
    one.metrics.model("x").count(200)
    assert (
        two.metrics.registry.get_sample_value(
            "shoal_frontend_requests_total", {"model": "x", "status": "200"}
        )
        is None
    )


async def test_a_reconcile_interval_shorter_than_a_hanging_metadata_fetch_keeps_the_frontend_ready(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """One worker whose metadata hangs (each fetch ends at the 1 s timeout, and is retried by
    reconciliation every 0.2 s) delays only its own card: the loop never waits on it."""
    slow = await start_worker("slow", register=False)
    slow.metadata_hang.clear()
    await start_worker("fast")
    frontend = await start_frontend(reconcile_interval=0.2, metadata_timeout=1.0)
    await slow.register(frontend.watcher.discovery.store)  # type: ignore[union-attr]
    not_ready: list[tuple[int, Any]] = []

    async def ready_while_fetches_hang() -> bool:
        status, body = await get(f"{frontend.url}/ready")
        if status != 200:
            not_ready.append((status, body))
        return slow.metadata_fetches >= 3 or bool(not_ready)

    # The event's fetch times out, then reconciliation retries it twice, each hanging 1 s.
    await wait_for(ready_while_fetches_hang, timeout=15)
    assert not_ready == []
    assert serving(frontend, "fast") and not serving(frontend, "slow")
    _, body = await get(f"{frontend.url}/health")
    assert [entry["state"] for entry in body["incomplete"]] == ["pending"]
    assert (await get(f"{frontend.url}/health/controllers"))[0] == 200
    slow.metadata_hang.set()
    await wait_for(lambda: serving(frontend, "slow"), timeout=5)


async def test_store_outage_shows_in_health_and_health_controllers_but_not_in_ready(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    etcd = own_etcd
    frontend = Frontend(
        FrontendConfig(store_url=etcd.url, port=0, cache_dir=tmp_path / "c", reconcile_interval=0.2)
    )
    try:
        await frontend.start()
        status, body = await get(f"{frontend.url}/health")
        assert (status, body["store"]) == (200, {"reachable": True})
        etcd.stop()
        status, body = await wait_for(
            lambda: _health_when(frontend, lambda body: not body["store"]["reachable"]),
            timeout=30,
        )
        assert status == 200  # /health keeps its meaning: the frontend still serves
        assert body["store"]["unreachable_since"].endswith("+00:00")
        assert body["store"]["error"]
        status, body = await wait_for(
            lambda: _controllers_when(frontend, "model-reconciler"), timeout=30
        )
        assert status == 503
        assert "steps failing for" in body["unhealthy"]["model-reconciler"]
        assert body["unhealthy"]["store"].startswith("unreachable since ")
        assert (await get(f"{frontend.url}/ready")) == (200, {"status": "ready"})
        etcd.start()
        await wait_for(lambda: _get_when(f"{frontend.url}/health/controllers", 200), timeout=30)
        status, body = await get(f"{frontend.url}/health")
        assert body["store"] == {"reachable": True}
    finally:
        await frontend.stop()


@pytest.mark.parametrize("fault", ["stopped", "paused"])
async def test_health_tells_a_store_outage_and_its_end_as_the_store_watch_sees_them(
    own_etcd: EtcdServer, tmp_path: Path, fault: str
) -> None:
    """`/health` learnt the store's state only from reconciliation listings, one an
    interval (30 s by default), as the store's watch retries on its own and never raises:
    it said the store reachable 29 s into an outage, and unreachable 29 s after it ended
    (`/health/controllers` 503 meanwhile). Now the watch tells it when it loses the store
    and when it has it back: with an interval of an hour, both show in `/health` and
    `/health/controllers` within the deadlines. `/ready` stays 200 throughout."""
    etcd = own_etcd
    assert etcd.proc is not None
    frontend = Frontend(
        FrontendConfig(
            store_url=etcd.url, port=0, cache_dir=tmp_path / "c", reconcile_interval=3600.0
        )
    )
    ready: set[int] = set()

    async def store_reachable(reachable: bool) -> bool:
        ready.add((await get(f"{frontend.url}/ready"))[0])
        status, body = await get(f"{frontend.url}/health")
        return status == 200 and body["store"]["reachable"] is reachable

    try:
        await frontend.start()
        assert await store_reachable(True)
        etcd.stop() if fault == "stopped" else etcd.proc.send_signal(signal.SIGSTOP)
        try:
            # (a paused etcd keeps its connections: the watch notices by keepalive, ~15 s)
            await wait_for(lambda: store_reachable(False), timeout=30, message="outage shown")
            status, body = await get(f"{frontend.url}/health/controllers")
            assert status == 503 and body["unhealthy"]["store"].startswith("unreachable since")
        finally:
            etcd.start() if fault == "stopped" else etcd.proc.send_signal(signal.SIGCONT)
        await wait_for(lambda: store_reachable(True), timeout=20, message="its end shown")
        await wait_for(lambda: _get_when(f"{frontend.url}/health/controllers", 200), timeout=5)
        assert ready == {200}
    finally:
        await frontend.stop()


async def _health_when(frontend: Frontend, check: Any) -> tuple[int, dict] | None:  # type: ignore[type-arg]
    status, body = await get(f"{frontend.url}/health")
    return (status, body) if check(body) else None


async def _controllers_when(frontend: Frontend, loop: str) -> tuple[int, dict] | None:  # type: ignore[type-arg]
    status, body = await get(f"{frontend.url}/health/controllers")
    return (status, body) if loop in body["unhealthy"] else None


async def _get_when(url: str, status: int) -> tuple[int, dict] | None:  # type: ignore[type-arg]
    got = await get(url)
    return got if got[0] == status else None


async def test_frontend_whose_store_never_answers_exits_non_zero_naming_it(
    tmp_path: Path,
) -> None:
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"etcd://127.0.0.1:{silent.getsockname()[1]}"
    try:
        proc = await shoal(
            "frontend", "--store", url, "--port", "0", "--setup-timeout", "1",
            "--cache-dir", str(tmp_path / "c"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        silent.close()
    assert proc.returncode == 1
    assert url in stderr.decode()
    assert b"ready" not in stdout


def sample(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name}{labels} in /metrics")


async def test_cards_that_cannot_be_read_are_counted_listed_and_unknown_fields_tolerated(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    good = await start_worker()
    newer = await start_worker("newer-llm")  # a newer worker's card: a field we do not know
    assert newer.lease is not None
    raw = msgspec.json.decode(newer.card().to_json())
    raw["speculative_decoding"] = {"draft": "tiny"}
    await store.put(newer.key.key, msgspec.json.encode(raw), lease=newer.lease.id)
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend) and serving(frontend, "newer-llm"))
    bad_role = ModelKey(good.endpoint, good.instance_id, "encode")
    raw = msgspec.json.decode(good.card().to_json()) | {"display_name": "enc", "role": "encode"}
    await store.put(bad_role.key, msgspec.json.encode(raw))
    not_json = ModelKey(good.endpoint, good.instance_id, "garbage")
    await store.put(not_json.key, b"{not json")

    def skipped(body: dict[str, Any]) -> dict[str, str]:
        return {entry["key"]: entry["reason"] for entry in body["skipped"]}

    status, body = await wait_for(
        lambda: _health_when(frontend, lambda body: len(skipped(body)) == 2)
    )
    assert status == 200
    reasons = skipped(body)
    assert "role" in reasons[bad_role.key]
    assert "JSON" in reasons[not_json.key]
    async with aiohttp.ClientSession() as session:
        metrics = await (await session.get(f"{frontend.url}/metrics")).text()
    malformed = "shoal_discovery_malformed_values_total"
    assert sample(metrics, malformed, '{kind="model"}') >= 2
    assert sample(metrics, "shoal_discovery_ignored_card_changes_total") >= 0
    assert serving(frontend)  # nothing valid is hidden by the bad values beside it
    await store.delete(not_json.key)
    await wait_for(lambda: _health_when(frontend, lambda body: len(skipped(body)) == 1))
    # A change other than taints to a registered card is ignored, and listed as such.
    changed = msgspec.structs.replace(good.card(), context_length=8192)
    assert good.lease is not None
    await store.put(good.key.key, changed.to_json(), lease=good.lease.id)
    _, body = await wait_for(lambda: _health_when(frontend, lambda body: len(skipped(body)) == 2))
    assert "ignored" in skipped(body)[good.key.key]
    async with aiohttp.ClientSession() as session:
        metrics = await (await session.get(f"{frontend.url}/metrics")).text()
    assert sample(metrics, "shoal_discovery_ignored_card_changes_total") >= 1
    assert serving(frontend)  # the registered card is kept


async def test_ready_is_503_with_the_reason_while_a_loop_is_stuck_and_health_keeps_its_meaning(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(reconcile_interval=0.2)
    assert await get(f"{frontend.url}/ready") == (200, {"status": "ready"})
    watcher = frontend.watcher
    assert watcher is not None
    stuck = asyncio.Event()
    apply = watcher._apply

    async def apply_never_ends(*args: Any, **kwargs: Any) -> Any:
        await stuck.wait()  # the loop's own work (not the store) never ends
        return await apply(*args, **kwargs)

    watcher._apply = apply_never_ends  # type: ignore[method-assign]
    _, body = await wait_for(lambda: _get_when(f"{frontend.url}/ready", 503))
    assert body["status"] == "not ready"
    assert "no progress for" in body["reasons"]["model-reconciler"]
    assert (await get(f"{frontend.url}/health"))[0] == 200
    assert (await get(f"{frontend.url}/live"))[0] == 200
    watcher._apply = apply  # type: ignore[method-assign]
    stuck.set()
    await wait_for(lambda: _get_when(f"{frontend.url}/ready", 200))


async def test_a_listing_the_store_does_not_answer_is_waiting_on_the_store_not_stuck(
    discovery: FilteringDiscovery, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=0.2)
    discovery.hold_listings = asyncio.Event()  # the store takes its time with the next listing
    status, body = await wait_for(
        lambda: _controllers_when(frontend, "model-reconciler"), message="the loop is silent"
    )
    assert status == 503
    assert body["unhealthy"]["model-reconciler"].endswith("waiting on the store")
    assert await get(f"{frontend.url}/ready") == (200, {"status": "ready"})
    discovery.hold_listings.set()
    await wait_for(lambda: _get_when(f"{frontend.url}/health/controllers", 200))


async def test_ready_is_503_while_starting_and_draining(
    discovery: FilteringDiscovery, tmp_path: Path
) -> None:
    discovery.list_failures = 3  # the store is not answering yet
    frontend = Frontend(FrontendConfig(port=0, cache_dir=tmp_path / "c"), discovery=discovery)
    starting = asyncio.create_task(frontend.start())
    try:
        await wait_for(lambda: frontend.server is not None and discovery.list_calls >= 1)
        status, body = await get(f"{frontend.url}/ready")
        assert (status, body["status"]) == (503, "not ready")
        assert "first discovery snapshot" in body["reasons"]["frontend"]
        await starting
        assert (await get(f"{frontend.url}/ready"))[0] == 200
        frontend.draining = True
        status, body = await get(f"{frontend.url}/ready")
        assert (status, body["reasons"]) == (503, {"frontend": "draining"})
        frontend.draining = False
    finally:
        await frontend.stop()


async def test_series_of_a_model_gone_for_a_while_are_dropped(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    stay = await start_worker()
    gone = await start_worker("gone-llm")
    frontend = await start_frontend()
    frontend.metrics.departed_ttl = 0.3  # seconds a departed model's series are kept
    await wait_for(lambda: serving(frontend) and serving(frontend, "gone-llm"))
    client = openai_client(frontend)
    for model in ("mock-llm", "gone-llm"):
        await client.chat.completions.create(model=model, messages=CHAT)
    registry = frontend.metrics.registry
    labels = {"model": "gone-llm", "status": "200"}
    assert registry.get_sample_value("shoal_frontend_requests_total", labels) == 1
    await gone.unregister()
    await wait_for(lambda: "gone-llm" not in frontend.registry.models)
    # Still shown for a while after it left (a scrape right after sees its last values)...
    assert registry.get_sample_value("shoal_frontend_requests_total", labels) == 1
    # ...then dropped, while the model that stays keeps its series.
    await wait_for(
        lambda: registry.get_sample_value("shoal_frontend_requests_total", labels) is None
    )
    assert "gone-llm" not in frontend.metrics.models
    stays = {"model": "mock-llm", "status": "200"}
    assert registry.get_sample_value("shoal_frontend_requests_total", stays) == 1
    assert stay.requests == 1


async def test_refused_cards_series_of_a_model_gone_for_a_while_is_dropped_without_requests(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """`cards_refused` was dropped only with a model's request series: a model that had a
    refused card but no request here kept its series for ever."""
    await start_worker()
    old = await start_worker("gone-llm", version="1")
    frontend = await start_frontend()
    frontend.metrics.departed_ttl = 0.3  # seconds a departed model's series are kept
    await wait_for(lambda: serving(frontend) and serving(frontend, "gone-llm"))
    new = await start_worker("gone-llm", version="2")  # another checksum: refused
    registry = frontend.metrics.registry
    refused = "shoal_frontend_cards_refused_total"
    await wait_for(lambda: registry.get_sample_value(refused, {"model": "gone-llm"}) == 1)
    assert "gone-llm" not in frontend.metrics.models  # no request for it here
    await new.unregister()
    await old.unregister()
    await wait_for(lambda: "gone-llm" not in frontend.registry.models)
    await wait_for(lambda: registry.get_sample_value(refused, {"model": "gone-llm"}) is None)
    assert serving(frontend)  # the model that stays is untouched


async def test_health_counts_every_spoiled_discovery_value_and_names_only_the_first(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """A writer that spoils 300 keys under the fleet's prefix does not make `/health` a
    listing of them: it counts them all and names the first `MAX_LISTED`, by key."""
    from shoal.bounds import MAX_LISTED

    good = await start_worker()
    spoiled = [ModelKey(good.endpoint, good.instance_id, f"garbage-{i:03d}") for i in range(300)]
    for key in spoiled:
        await store.put(key.key, b"{not json")
    frontend = await start_frontend()
    status, body = await wait_for(
        lambda: _health_when(frontend, lambda body: body.get("skipped_total") == 300)
    )
    assert status == 200
    await wait_for(lambda: serving(frontend))  # nothing valid is hidden by them
    assert [entry["key"] for entry in body["skipped"]] == sorted(k.key for k in spoiled)[
        :MAX_LISTED
    ]
