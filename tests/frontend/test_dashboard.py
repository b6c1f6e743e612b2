"""`/ui`: the dashboard's snapshot, its event stream of changes, its access rules and history.

In-process frontends over fake workers; the browser tests are in `test_dashboard_browser.py`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

from shoal.cli.scope import membership_for
from shoal.controllers import Controller, Loop
from shoal.discovery import Discovery
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.dashboard.dashboard import StaticFiles
from shoal.frontend.dashboard.snapshot import RequestHistory, percentile
from shoal.frontend.registry.metrics import FrontendMetrics, ModelStats
from shoal.membership import parse_sources
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker, openai_client
from tests.frontend.support import FakeWorker, serving
from tests.helpers import wait_for


async def snapshot(frontend: Frontend, **kwargs: Any) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        response = await session.get(f"{frontend.url}/ui/api/snapshot", **kwargs)
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body


def by_key(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["key"]: item for item in items}


class Events:
    """The events of one open `/ui/api/events` stream, read in a task as they arrive."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        event, data = "message", ""
        async for raw in self.response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
            elif not line and data:
                self.received.append((event, json.loads(data)))
                event, data = "message", ""

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [data for event, data in self.received if event == kind]


@asynccontextmanager
async def events(frontend: Frontend, **kwargs: Any) -> AsyncIterator[Events]:
    async with aiohttp.ClientSession() as session:
        response = await session.get(f"{frontend.url}/ui/api/events", **kwargs)
        assert response.status == 200, await response.text()
        assert response.headers["content-type"] == "text/event-stream"
        stream = Events(response)
        try:
            yield stream
        finally:
            stream.task.cancel()
            await asyncio.gather(stream.task, return_exceptions=True)
            response.close()


async def test_snapshot_shows_models_instances_states_incomplete_loops_and_no_routes(
    start_frontend: StartFrontend, start_worker: StartWorker, store: Store
) -> None:
    ready = await start_worker()
    draining = await start_worker()
    stuck = await start_worker(version="2", register=False)
    stuck.metadata_hang.clear()  # its card cannot join: its metadata never arrives
    await stuck.register(store)
    frontend = await start_frontend(namespaces=("default",), metadata_timeout=60.0)
    await wait_for(lambda: serving(frontend, instances=2))
    await draining.taint("draining")
    await wait_for(lambda: frontend.registry.models["mock-llm"].live_instances == 1)

    snap = await snapshot(frontend)
    instances = by_key(snap["instances"])
    key = "default/backend/generate/{:x}"
    assert instances[key.format(ready.instance_id)]["state"] == "ready"
    assert instances[key.format(draining.instance_id)]["state"] == "draining"
    assert instances[key.format(draining.instance_id)]["taints"] == ["draining"]
    assert instances[key.format(stuck.instance_id)]["state"] == "pending"
    assert instances[key.format(ready.instance_id)]["models"] == ["mock-llm"]
    assert instances[key.format(ready.instance_id)]["kv_hit_rate"] is None
    (model,) = snap["models"]
    assert model["name"] == "mock-llm" and model["serving"] and model["live_instances"] == 1
    (worker_set,) = model["sets"]
    assert worker_set["namespace"] == "default" and worker_set["component"] == "backend"
    assert worker_set["role"] == "aggregated"
    assert worker_set["mdcsum"] == ready.card().mdcsum
    assert (worker_set["members"], worker_set["routable"]) == (2, 1)
    (incomplete,) = snap["incomplete"]
    assert incomplete["instance_id"] == f"{stuck.instance_id:x}"
    assert incomplete["state"] == "pending"
    loops = by_key([{"key": loop["name"], **loop} for loop in snap["loops"]])
    assert loops["model-reconciler"]["healthy"] is True
    assert loops["model-reconciler"]["heartbeat_age"] >= 0
    assert snap["membership"] is None
    assert snap["routes"] == []  # filled once the frontend follows shoal/v1/routes/
    assert snap["frontend"]["loaded"] is True and snap["frontend"]["protected"] is False
    stuck.metadata_hang.set()


class Hung(Controller):
    """A controller whose step never returns: its loop stops making progress."""

    async def step(self) -> None:
        await asyncio.Event().wait()


async def test_tainted_instances_and_unhealthy_loops_show_with_their_reason(
    start_frontend: StartFrontend, start_worker: StartWorker
) -> None:
    worker = await start_worker()
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend))
    await worker.taint("maintenance")
    await wait_for(lambda: not serving(frontend))
    loop = frontend.manager.register(Loop(Hung(), interval=0.05, max_silence=0.2, name="hung"))
    await loop.start()
    try:
        await wait_for(lambda: not loop.health().healthy)
        snap = await snapshot(frontend)
    finally:
        await loop.stop(0.1)
    (row,) = snap["instances"]
    assert (row["state"], row["taints"]) == ("tainted", ["maintenance"])
    loops = {entry["name"]: entry for entry in snap["loops"]}
    assert loops["hung"]["healthy"] is False
    assert loops["hung"]["reason"].startswith("no progress for")
    assert loops["hung"]["heartbeat_age"] >= 0.2


async def test_membership_section_shows_desired_and_applied_revision_and_namespaces(
    start_worker: StartWorker, store: Store, tmp_path: Path
) -> None:
    await start_worker(namespace="team-a")
    path = tmp_path / "sources.json"
    path.write_text(json.dumps({"version": 1, "sources": [{"namespace": "team-a"}]}))
    revision = parse_sources(path.read_bytes()).revision
    config = FrontendConfig(port=0, cache_dir=tmp_path / "cache", namespace_sources=path)
    frontend = Frontend(config, discovery=Discovery(store), membership=membership_for(config))
    await frontend.start()
    try:
        snap = await snapshot(frontend)
        assert snap["membership"] == {
            "status": {
                "desired_revision": revision,
                "applied_revision": revision,
                "count": 1,
                "last_error": None,
            },
            "namespaces": ["team-a"],
        }
        assert snap["frontend"]["follows_membership"] is True
    finally:
        await frontend.stop()


async def test_routes_section_is_empty_until_a_routes_source_fills_it(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend()
    assert (await snapshot(frontend))["routes"] == []
    route = {  # the shape of a route under shoal/v1/routes/{workspace}/{name}
        "workspace": "team-a",
        "name": "fast",
        "targets": [{"kind": "fleet", "model": "mock-llm", "weight": 1}],
    }
    frontend.dashboard.reader.routes = lambda: [route]
    # Reads are spaced by BUSY_SHARE times the last one's time, and a routes source has no
    # version the dashboard could compare: the next read after that space shows the route.

    async def routes() -> list[dict[str, Any]]:
        shown: list[dict[str, Any]] = (await snapshot(frontend))["routes"]
        return shown

    shown = await wait_for(routes, message="the route shown")
    assert shown == [{"key": "team-a/fast", **route}]


async def test_event_stream_sends_a_snapshot_then_each_change_within_two_seconds(
    start_frontend: StartFrontend, start_worker: StartWorker
) -> None:
    frontend = await start_frontend()
    async with events(frontend) as stream:
        await wait_for(lambda: stream.of("snapshot"))
        assert stream.of("snapshot")[0]["instances"] == []
        worker = await start_worker()
        key = f"default/backend/generate/{worker.instance_id:x}"
        started = time.monotonic()

        def upserted(state: str) -> bool:
            return any(
                item["key"] == key and item["state"] == state
                for change in stream.of("change")
                for item in change.get("upsert", {}).get("instances", [])
            )

        await wait_for(lambda: upserted("ready"), timeout=2.0)
        assert time.monotonic() - started < 2.0
        await worker.taint("draining")
        await wait_for(lambda: upserted("draining"), timeout=2.0)
        await worker.unregister()
        await wait_for(
            lambda: any(
                key in change.get("remove", {}).get("instances", [])
                for change in stream.of("change")
            ),
            timeout=2.0,
        )
    # Changes carry only what changed: the unchanged frontend section is never resent.
    assert not any("frontend" in change.get("set", {}) for change in stream.of("change"))


async def test_page_is_public_but_fleet_data_needs_the_key_as_cookie_or_bearer(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(api_keys=("s3cret",))
    jar = aiohttp.CookieJar(unsafe=True)  # keep cookies from an IP address
    async with aiohttp.ClientSession(cookie_jar=jar) as session:
        page = await session.get(f"{frontend.url}/ui/")
        assert page.status == 200 and "text/html" in page.headers["content-type"]
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for route in ("snapshot", "events"):
            refused = await session.get(f"{frontend.url}/ui/api/{route}")
            assert refused.status == 401
            assert (await refused.json())["error"]["code"] == "invalid_api_key"
        wrong = await session.post(f"{frontend.url}/ui/api/login", json={"key": "guess"})
        assert wrong.status == 401 and "set-cookie" not in wrong.headers
        bad = await session.post(f"{frontend.url}/ui/api/login", data=b"not json")
        assert bad.status == 400
        assert "key" in (await bad.json())["error"]["message"]
        login = await session.post(f"{frontend.url}/ui/api/login", json={"key": "s3cret"})
        assert login.status == 200
        cookie = login.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "s3cret" not in cookie
        assert (await session.get(f"{frontend.url}/ui/api/snapshot")).status == 200
        await session.post(f"{frontend.url}/ui/api/logout")
        assert (await session.get(f"{frontend.url}/ui/api/snapshot")).status == 401
    snap = await snapshot(frontend, headers={"Authorization": "Bearer s3cret"})
    assert snap["frontend"]["protected"] is True


async def test_static_files_ship_in_the_package_and_ui_redirects_to_its_page(
    start_frontend: StartFrontend,
) -> None:
    assert {"index.html", "app.js", "style.css"} <= set(StaticFiles().files)
    frontend = await start_frontend()
    async with aiohttp.ClientSession() as session:
        moved = await session.get(f"{frontend.url}/ui", allow_redirects=False)
        assert (moved.status, moved.headers["location"]) == (308, "/ui/")
        script = await session.get(f"{frontend.url}/ui/app.js")
        assert script.status == 200 and "javascript" in script.headers["content-type"]
        assert (await session.get(f"{frontend.url}/ui/nothing.js")).status == 404
        assert (await session.post(f"{frontend.url}/ui/api/snapshot")).status == 405
        assert (await session.get(f"{frontend.url}/ui/api/login")).status == 405
        assert (await session.get(f"{frontend.url}/ui/api/nothing")).status == 404


async def test_a_failing_instance_counts_errors_and_shows_inhibited(
    start_frontend: StartFrontend, start_worker: StartWorker
) -> None:
    worker = await start_worker()
    healthy = await start_worker()
    frontend = await start_frontend(inhibit_seconds=60.0)
    await wait_for(lambda: serving(frontend, instances=2))
    worker.fail_next = 1_000
    async with openai_client(frontend) as client:
        while not worker.requests:  # round-robin reaches the failing one within two requests
            await client.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": "hi"}]
            )
    key = f"default/backend/generate/{worker.instance_id:x}"
    async with events(frontend) as stream:  # sampled by the timer
        await wait_for(lambda: stream.of("snapshot"))
    row = by_key(stream.of("snapshot")[0]["instances"])[key]
    assert row["state"] == "inhibited" and row["inhibited"] is True
    assert row["errors"] == 1
    other = by_key(stream.of("snapshot")[0]["instances"])[
        f"default/backend/generate/{healthy.instance_id:x}"
    ]
    assert (other["state"], other["errors"]) == ("ready", 0)


async def test_stopping_the_frontend_ends_open_event_streams_at_once(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(drain_timeout=30.0)
    async with events(frontend) as stream:
        await wait_for(lambda: stream.of("snapshot"))
        started = time.monotonic()
        await frontend.stop()
        assert time.monotonic() - started < 5.0  # not the 30 s drain timeout
        await asyncio.wait_for(stream.task, 5.0)  # the server closed the stream


def test_request_history_turns_counters_into_rates_and_ttft_percentiles() -> None:
    metrics = FrontendMetrics()
    history = RequestHistory(metrics, period=2.0, size=3)
    assert history.sample(now=100.0) is None  # the first sample is the baseline
    stats = metrics.model("m")
    for _ in range(8):
        stats.count(200)
    stats.count(404)
    stats.count(503)
    for seconds in (0.02, 0.02, 0.02, 0.4):
        stats.ttft.observe(seconds)
    point = history.sample(now=102.0)
    assert point is not None
    assert point["rps"] == 5.0  # 10 requests in 2 s
    assert (point["client_errors"], point["server_errors"]) == (0.5, 0.5)
    assert 0.01 < point["ttft_p50"] <= 0.025
    assert 0.25 < point["ttft_p95"] <= 0.5
    quiet = history.sample(now=104.0)
    assert quiet is not None and quiet["rps"] == 0.0 and quiet["ttft_p50"] is None
    history.sample(now=106.0)
    history.sample(now=108.0)
    assert [p["t"] for p in history.points] == [104.0, 106.0, 108.0]  # a ring of `size`


class _Unwalkable(dict[str, ModelStats]):
    """Per-model stats that fail the test if anything walks them all."""

    def values(self) -> Any:
        raise AssertionError("walked every model's stats")

    def items(self) -> Any:
        raise AssertionError("walked every model's stats")

    def __iter__(self) -> Any:
        raise AssertionError("walked every model's stats")


def test_request_history_reads_process_totals_not_every_model() -> None:
    metrics = FrontendMetrics()
    history = RequestHistory(metrics, period=2.0)
    for name in ("a", "b", "c"):
        stats = metrics.model(name)
        stats.count(200)
        stats.count(503)
        stats.ttft.observe(0.02)
    assert metrics.totals.requests == {200: 3, 503: 3}  # bumped with each model's counters
    assert sum(metrics.totals.ttft) == 3
    history.sample(now=100.0)
    metrics.models = _Unwalkable(metrics.models)  # a sample's work must not grow with models
    metrics.model("a").count(404)
    metrics.model("b").ttft.observe(0.4)
    point = history.sample(now=102.0)
    assert point is not None
    assert (point["rps"], point["client_errors"], point["server_errors"]) == (0.5, 0.5, 0.0)
    assert point["ttft_p50"] is not None and 0.25 < point["ttft_p50"] <= 0.5


def test_request_history_keeps_counting_when_a_departed_models_series_are_dropped() -> None:
    clock = [0.0]
    metrics = FrontendMetrics(departed_ttl=600.0, clock=lambda: clock[0])
    present = {"old": 1, "live": 1}
    metrics.live_instances = lambda: dict(present)
    for _ in range(1_000):
        metrics.model("old").count(200)  # its past traffic
    history = RequestHistory(metrics, period=2.0)
    del present["old"]
    metrics.drop_departed()
    history.sample(now=1000.0)
    clock[0] += 601.0
    for status in [200] * 8 + [503] * 2:
        metrics.model("live").count(status)
    metrics.drop_departed()  # the departed model's series go from /metrics...
    assert "old" not in metrics.models
    point = history.sample(now=1002.0)
    assert point is not None  # ...but not from the chart: 10 requests in 2 s, 2 of them 5xx
    assert (point["rps"], point["server_errors"]) == (5.0, 1.0)


def test_percentile_of_an_empty_histogram_is_unknown() -> None:
    assert percentile([0] * 14, 0.5) is None
    assert percentile([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4], 0.5) == 60.0


async def test_virtual_models_published_in_discovery_show_in_the_routes_section(
    start_frontend: StartFrontend, start_worker: StartWorker, store: Store
) -> None:
    from shoal.discovery import FleetTarget, Route, publish_route

    frontend = await start_frontend()
    await start_worker()
    await wait_for(lambda: serving(frontend))
    await publish_route(
        store, Route(workspace="default", name="fast", targets=(FleetTarget(model="mock-llm"),))
    )
    await wait_for(lambda: "fast" in frontend.routes.models)
    (shown,) = (await snapshot(frontend))["routes"]
    assert shown["key"] == "default/fast" and shown["serving"] is True
    assert shown["targets"][0]["kind"] == "fleet" and shown["targets"][0]["model"] == "mock-llm"


class WorkerWithCredentials(FakeWorker):
    """A worker announced at a URL with Basic credentials (the frontend sends them)."""

    @property
    def url(self) -> str:
        return f"http://svc:hunter2@127.0.0.1:{self.port}"


async def test_instance_urls_show_without_their_credentials(
    start_frontend: StartFrontend, store: Store
) -> None:
    """Any holder of an API key (every client) reads the dashboard's data: an instance URL's
    credentials, which only the frontend needs, showed there."""
    worker = await WorkerWithCredentials().start()
    try:
        await worker.register(store)
        frontend = await start_frontend()
        await wait_for(lambda: serving(frontend))
        snap = await snapshot(frontend)
        (row,) = snap["instances"]
        assert row["url"] == f"http://***@127.0.0.1:{worker.port}/v1"
        assert "hunter2" not in json.dumps(snap)
    finally:
        await worker.stop()
        if worker.lease is not None:
            await worker.lease.revoke()


async def test_the_routes_section_lets_the_loop_run_between_wide_routes() -> None:
    """The routes section was encoded in one turn of the loop, whatever its size (100 routes
    of 256 targets: 68-81 ms, 7 MB, at every read). Now a route costs a row per target and
    the read yields every `SLICE` of that: counted here in turns of the loop."""
    from shoal.frontend.dashboard.snapshot import ROW_COST, SLICE, FleetReader, _Turns

    targets = [{"kind": "url", "model": f"m{i}", "base_url": "https://p.example.com/v1"}
               for i in range(16)]  # fmt: skip
    routes = [{"workspace": "w", "name": f"vm{i:03d}", "targets": targets} for i in range(100)]
    reader = FleetReader(None)  # type: ignore[arg-type]  # (only `routes` is read)
    reader.routes = lambda: routes
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # (the ticker runs)
    before = ticks
    shown = await reader._routes(_Turns())
    turns = ticks - before
    ticker.cancel()
    assert sorted(shown) == [f"w/vm{i:03d}" for i in range(100)]
    assert turns >= len(routes) * (1 + len(targets)) * ROW_COST // SLICE - 1
