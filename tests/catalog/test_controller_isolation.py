"""One bad resource affects only itself (SQLite and PostgreSQL): a row the client cannot read,
a deployment that cannot start, a route the store refuses, a hung provider; and the
listings the controller acts on are consistent, so no untouched route ever disappears."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy.exc
from aiohttp import web

from shoal.catalog import DEPLOYMENTS, MODELS, PROVIDERS, VIRTUAL_MODELS, CatalogServer
from shoal.catalog import client as client_module
from shoal.catalog.backends import LocalBackend
from shoal.catalog.client import CatalogClient, read_items
from shoal.catalog.controller import ControllerConfig, ModelsControllerService
from shoal.catalog.database import open_engine
from shoal.catalog.errors import CatalogError, InvalidError, NotFoundError
from shoal.catalog.repository import Repository
from shoal.catalog.resources import Model
from shoal.catalog.routing import routes_prefix
from shoal.catalog.tables import workspaces
from shoal.controllers import ControllerManager, Loop
from shoal.discovery import decode_route, route_key
from shoal.store import Delete, Put, Resync
from tests.catalog.controller_fixtures import (
    WS,
    FakeBackend,
    RecordingClient,
    controller_on,
    insert_rows,
    openai_servers,
    seed_converged,
)
from tests.catalog.test_cli import catalog_cli
from tests.helpers import Server, wait_for


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


async def test_a_row_the_client_cannot_read_affects_only_itself(
    catalog: CatalogServer, database_url: str
) -> None:
    """Rows left by an older catalog: a model whose `spec` nests 300 levels (readable), a
    entity, a virtual model and a deployment that no longer validate. The pass goes on
    for everything else, leaves the unreadable ones' route and workers alone, and
    `/health/controllers` stays 200."""
    backend = FakeBackend()
    await insert_rows(database_url, MODELS, WS, [
        {"name": "deep", "spec": nested(300)},
        {"name": "odd-model", "providers": "not a list"},
    ])  # fmt: skip
    await insert_rows(database_url, VIRTUAL_MODELS, WS, [
        {"name": "broken", "default_model": "deep", "targets": "not a list"},
        {"name": "via-odd", "default_model": "odd-model"},
    ])  # fmt: skip
    await insert_rows(database_url, DEPLOYMENTS, WS, [
        {"name": "odd", "model": "m", "engine": "no-such-engine", "status": "READY"},
    ])  # fmt: skip
    async with controller_on(catalog.url, backend=backend) as (ctl, client, store):
        backend.runs.add((WS, "odd"))  # its workers, started before the row went bad
        for name in ("broken", "via-odd"):  # routes published before the rows went bad
            route = f'{{"workspace":"team-a","name":"{name}","targets":[{{"kind":"fleet","model":"m"}}]}}'
            await store.put(route_key(WS, name), route.encode())
        held = {n: await store.get(route_key(WS, n)) for n in ("broken", "via-odd")}
        await client.create(VIRTUAL_MODELS, {"name": "chat", "default_model": "deep"})
        await client.create(VIRTUAL_MODELS, {"name": "new", "default_model": "x"}, workspace="b")
        assert [m.name for m in await client.list_all(MODELS)] == ["deep"]  # read, at 300
        loop = Loop(ctl, interval=0.2, name="models-controller")
        catalog.controllers = ControllerManager([loop])
        await catalog.controllers.start_all()
        try:
            await wait_for(lambda: ctl.passes >= 3, timeout=30)
            async with aiohttp.ClientSession() as http:
                for probe in ("/health/controllers", "/ready", "/live"):
                    async with http.get(f"{catalog.url}{probe}") as resp:
                        assert resp.status == 200, (probe, await resp.text())
        finally:
            await catalog.controllers.stop_all(timeout=1.0)
            catalog.controllers = None
        assert ctl.last is not None and ctl.last.failed == {}
        assert await store.get(route_key(WS, "chat")) is not None
        assert await store.get(route_key("b", "new")) is not None  # the other workspace too
        for name, kv in held.items():  # not judged: kept as they were
            now = await store.get(route_key(WS, name))
            assert kv is not None and now is not None and now.mod_revision == kv.mod_revision
        assert (WS, "odd") in backend.runs and "odd" not in backend.stopped


async def test_the_client_reads_every_workspace_past_the_first_page(
    catalog: CatalogServer, database_url: str
) -> None:
    engine = open_engine(database_url)
    now = datetime.now(UTC)
    try:
        async with engine.begin() as conn:
            rows = [{"name": f"w{n:04d}", "version": 1, "created_at": now} for n in range(1001)]
            await conn.execute(workspaces.insert(), rows)
    finally:
        await engine.dispose()
    async with RecordingClient(catalog.url) as client:
        found = [w.name for w in await client.workspaces()]
        assert len(found) == 1001 and found[-1] == "w1000"
        assert [w.name for w in await client.workspaces(page_size=250)] == found


async def test_a_deployment_that_cannot_start_is_error_and_its_workspace_proceeds(
    catalog: CatalogServer, database_url: str, tmp_path: Path
) -> None:
    """Log file names are bounded (120 bytes, a hash suffix) whatever the workspace and
    name (errno 36 came from them when names could be 200 long); errno 7 (engine_args too
    large for a command line, a row from before the API's bound) makes that deployment
    ERROR with the reason, and the workspace's other resources go on."""
    workspace, long_name = "w" * 63, "d" * 150
    await insert_rows(database_url, DEPLOYMENTS, workspace, [
        {"name": "huge-args", "model": "m", "engine": "mocker",
         "engine_args": {"blob": "x" * 200_000}, "status": "CREATED"},
    ])  # fmt: skip
    backend = LocalBackend("memory://nowhere", tmp_path, backoff_first=60.0)
    async with controller_on(catalog.url, workspaces=[workspace], backend=backend) as (
        ctl, client, store,
    ):  # fmt: skip
        try:
            await client.create(DEPLOYMENTS, {"name": long_name, "model": "m", "engine": "mocker"},
                                workspace=workspace)  # fmt: skip
            await client.create(VIRTUAL_MODELS, {"name": "chat", "default_model": "m"},
                                workspace=workspace)  # fmt: skip
            await ctl.step()
            assert ctl.last is not None and ctl.last.failed == {}
            huge = await client.get(DEPLOYMENTS, "huge-args", workspace=workspace)
            assert huge.status == "ERROR"
            assert "cannot start" in huge.status_message
            assert "Argument list too long" in huge.status_message  # errno 7, named
            assert (await client.get(DEPLOYMENTS, long_name, workspace=workspace)).status == (
                "PENDING"
            )
            assert backend.pids(workspace, long_name)  # started, its log file bounded
            logs = [p.name for p in await asyncio.to_thread(lambda: list(tmp_path.iterdir()))]
            assert logs and all(len(name) <= 120 for name in logs), logs
            assert await store.get(route_key(workspace, "chat")) is not None
        finally:
            await backend.close()


async def test_a_route_the_store_refuses_is_reported_and_the_others_are_published(
    catalog: CatalogServer, database_url: str
) -> None:
    """A virtual model of 1,000 targets on a provider whose base_url is 2,000 bytes long
    resolved to a 2 MB route, over the store's 1 MiB (and over the 256 targets a frontend
    reads, which now refuses it first): its virtual model says why, every other route of
    the workspace is published."""
    served = {"p": [f"m{i:04d}" for i in range(1000)]}
    await seed_converged(database_url, served)
    base_url = "http://127.0.0.1:1/" + "v" * 1980
    async with controller_on(catalog.url, workspaces=[WS]) as (ctl, client, store):
        await client.update(PROVIDERS, "p", {"base_url": base_url})  # refused: listing ERROR
        await insert_rows(database_url, VIRTUAL_MODELS, WS, [
            {"name": "huge", "default_model": "m0000",
             "targets": [{"model_entity": n, "weight": 1} for n in served["p"]]},
        ])  # fmt: skip
        await ctl.step()
        assert ctl.last is not None and ctl.last.failed == {}
        held = {kv.key for kv in (await store.get_prefix(routes_prefix(WS))).items}
        assert held == {route_key(WS, n) for n in served["p"]}  # every other route
        huge = await client.get(VIRTUAL_MODELS, "huge")
        assert "route not published" in huge.status_message
        assert "1000 targets" in huge.status_message and "over 256" in huge.status_message
        await ctl.step()  # converged: the message is not written again
        assert (await client.get(VIRTUAL_MODELS, "huge")).version == huge.version


async def test_no_untouched_route_disappears_while_another_client_deletes_and_recreates_one(
    catalog: CatalogServer, database_url: str
) -> None:
    """1,001 virtual models, two pages; between the pages of each listing another client
    deletes (and re-creates) the first one. Listings page by key and a route is deleted
    only after a read by name: the store sees no delete of any other route."""
    names = [f"m{i:04d}" for i in range(1001)]
    await seed_converged(database_url, {"p": names})
    async with (
        openai_servers(names) as [server],
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, store),
        RecordingClient(catalog.url, workspace=WS) as other,
    ):
        await client.update(PROVIDERS, "p", {"base_url": server.base_url})
        await ctl.step()
        start = (await store.get_prefix(routes_prefix(WS))).revision
        deleted: list[str] = []
        seen = [start]

        async def watch() -> None:
            async for event in store.watch(routes_prefix(WS), start + 1):
                assert not isinstance(event, Resync)
                if isinstance(event, Delete):
                    deleted.append(event.key)
                if isinstance(event, Put | Delete):
                    seen[0] = event.revision

        async def between_pages(call: str, params: Any) -> None:
            """Between the two pages of a virtual-model listing: delete m0000, or re-create
            it if it is gone (a deleted row shifts the offset of every row after it)."""
            second_page = any(k == "after" or (k, v) == ("page", "2") for k, v in params or [])
            if not (call.endswith("/virtual-models") and second_page):
                return
            try:
                await other.delete(VIRTUAL_MODELS, "m0000")
            except NotFoundError:
                await other.create(VIRTUAL_MODELS, {"name": "m0000", "default_model": "m0000"})

        watcher = asyncio.create_task(watch())
        try:
            client.before = between_pages
            for _ in range(4):
                await ctl.step()
            client.before = None
            await store.put(route_key(WS, "zz-marker"), b"{}")  # the last event to wait for
            last = (await store.get_prefix(routes_prefix(WS))).revision
            await wait_for(lambda: watcher.done() or seen[0] >= last, timeout=10)
            await store.delete(route_key(WS, "zz-marker"))
        finally:
            watcher.cancel()
        assert set(deleted) <= {route_key(WS, "m0000")}, deleted
        held = {kv.key for kv in (await store.get_prefix(routes_prefix(WS))).items}
        assert held >= {route_key(WS, n) for n in names[1:]}


async def test_hung_url_providers_are_error_and_the_loop_stays_healthy(
    catalog: CatalogServer, tmp_path: Path
) -> None:
    """Three providers that never answer and one that does: listed at once, each within a
    timeout below the loop's max_silence, so every pass ends in about one timeout, the hung
    ones are ERROR with the reason, and the loop is healthy throughout."""
    interval = 0.8  # provider timeout 1.6 s (two intervals), max_silence 2.4 s
    config = ControllerConfig(
        catalog_url=catalog.url, store_url="memory://hung-providers", interval=interval,
        log_dir=tmp_path, leader_ttl=1.0,
    )  # fmt: skip
    async with openai_servers(["a"], [], [], []) as servers:
        for server in servers[1:]:
            server.delay = 3600.0  # hung: holds the request, never answers
        async with RecordingClient(catalog.url, workspace=WS) as client:
            for i, server in enumerate(servers):
                await client.create(PROVIDERS, {"name": f"p{i}", "type": "url",
                                                "base_url": server.base_url})  # fmt: skip
            service = ModelsControllerService(config)
            await service.start()
            try:
                loop = service.manager.loops["models-controller"]
                controller = service.controller
                assert controller is not None
                unhealthy: list[str] = []
                deadline = time.monotonic() + 30
                while controller.passes < 2 and time.monotonic() < deadline:
                    health = loop.health()
                    if not health.healthy:
                        unhealthy.append(health.reason or "")
                    await asyncio.sleep(0.02)  # sampling the probe, as a readiness check would
                assert controller.passes >= 2
                assert unhealthy == []
                assert controller.last is not None
                assert controller.last.seconds < 3 * 2 * interval  # not one timeout each
                providers = {p.name: p for p in await client.list_all(PROVIDERS)}
                assert providers["p0"].status == "READY"
                for name in ("p1", "p2", "p3"):
                    assert providers[name].status == "ERROR"
                    assert "no answer within" in providers[name].status_message
            finally:
                await service.stop()


async def test_keyset_pages_are_named_after_the_cursor_and_only_by_name(
    catalog: CatalogServer,
) -> None:
    async with RecordingClient(catalog.url, workspace=WS) as client:
        for name in ("a", "b", "c", "d"):
            await client.create(VIRTUAL_MODELS, {"name": name, "default_model": name})
        page = await client.list(VIRTUAL_MODELS, page_size=2, after="a")
        assert [vm.name for vm in page.items] == ["b", "c"] and page.last == "c"
        pages = [p async for p in client.pages(VIRTUAL_MODELS, page_size=2)]
        assert [[vm.name for vm in p.items] for p in pages] == [["a", "b"], ["c", "d"], []]
        with pytest.raises(InvalidError) as refused:
            await client.list(VIRTUAL_MODELS, sort="-name", after="a")
        assert refused.value.param == "after"


async def test_catalog_get_lists_every_readable_row_and_names_the_others(
    catalog: CatalogServer, database_url: str
) -> None:
    await insert_rows(database_url, MODELS, "default", [
        {"name": "deep", "spec": nested(64)},
        {"name": "deeper", "spec": nested(300)},
        {"name": "odd", "providers": "not a list"},
        {"name": "plain"},
    ])  # fmt: skip
    code, out, err = await catalog_cli("get", "models", "-o", "json", "--url", catalog.url)
    assert code == 0, err
    assert [row["name"] for row in json.loads(out)] == ["deep", "plain"]
    assert "models odd: cannot be read: providers" in err
    assert "models deeper: cannot be printed" in err


def test_a_page_nested_past_what_the_decoder_follows_is_a_catalog_error() -> None:
    """Items are validated one by one; a page too deep to decode at all is one error of that
    listing (its workspace's), never a RecursionError."""
    deep = b'{"a":' * 2000 + b"{}" + b"}" * 2000
    with pytest.raises(CatalogError, match="not a page"):
        read_items(Model, b'{"items":[' + deep + b'],"total":1}')
    page = read_items(Model, b'{"items":[{"name":"x"},{"name":"y","workspace":"w","version":1,'
                      b'"created_at":"2026-01-01T00:00:00Z","updated_at":"2026-01-01T00:00:00Z"}],'
                      b'"total":2}')  # fmt: skip
    assert [m.name for m in page.items] == ["y"] and list(page.invalid) == ["x"]


async def test_a_page_is_validated_a_slice_at_a_time_between_turns_of_the_loop() -> None:
    """A 1,000-item page of entities was validated in one piece (~30-60 ms of the event loop
    the controller's process also serves the API on): now a slice at a time, with the same
    items and the same invalid ones as reading it whole."""
    meta = (',"workspace":"w","version":1,"created_at":"2026-01-01T00:00:00Z",'
            '"updated_at":"2026-01-01T00:00:00Z"')  # fmt: skip
    rows = [f'{{"name":"m{i}"{meta if i % 7 else ""}}}' for i in range(1000)]
    raw = ('{"items":[' + ",".join(rows) + '],"total":1000}').encode()
    turns = [0]
    during: list[int] = []

    async def count() -> None:
        while True:
            turns[0] += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count())
    await asyncio.sleep(0)
    real = client_module._validate

    def validate(*args: Any) -> None:
        during.append(turns[0])
        real(*args)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(client_module, "_validate", validate)
            page = await client_module.read_items_sliced(Model, raw)
    finally:
        counter.cancel()
    whole = read_items(Model, raw)
    assert [m.name for m in page.items] == [m.name for m in whole.items]
    assert page.invalid == whole.invalid and len(page.invalid) == 143
    # at most VALIDATED_PER_TURN items between two turns of the loop (fewer on a slow machine)
    assert len(set(during)) >= 1000 // client_module.VALIDATED_PER_TURN


def _database_blip(monkeypatch: pytest.MonkeyPatch, method: str, kind_plural: str) -> list[str]:
    """`Repository.<method>` of `kind_plural` fails once as a database restart does (the
    pooled connection reset); the list returned records each failure."""
    real = getattr(Repository, method)
    failures: list[str] = []

    async def blip(self: Repository, kind: Any, *args: Any, **kwargs: Any) -> Any:
        if kind.plural == kind_plural and not failures:
            failures.append(kind_plural)
            raise sqlalchemy.exc.OperationalError(
                "UPDATE ...", {}, ConnectionResetError("connection was closed (test)")
            )
        return await real(self, kind, *args, **kwargs)

    monkeypatch.setattr(Repository, method, blip)
    return failures


async def test_a_database_blip_is_a_503_and_never_stops_a_deployment(
    catalog: CatalogServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database restart while the controller writes a deployment's status: the API answers
    503 in the OpenAI format (not a plain-text 500), the client raises it as a CatalogError,
    and the controller leaves the deployment and its workers to the next pass, which
    writes READY (before, the undecodable 500 stopped the workers and wrote ERROR)."""
    backend = FakeBackend()
    async with controller_on(catalog.url, workspaces=[WS], backend=backend) as (ctl, client, _):
        await client.create(DEPLOYMENTS, {"name": "mock", "model": "m", "engine": "mocker"})
        await ctl.step()
        assert (await client.get(DEPLOYMENTS, "mock")).status == "PENDING"
        failures = _database_blip(monkeypatch, "update", "deployments")
        await ctl.step()  # all ready: READY is written... the database restarts meanwhile
        assert failures == ["deployments"]
        assert backend.stopped == [] and backend.running() == {(WS, "mock")}
        assert (await client.get(DEPLOYMENTS, "mock")).status == "PENDING"
        assert ctl.last is not None and ctl.last.failed == {}
        await ctl.step()  # the database is back
        assert (await client.get(DEPLOYMENTS, "mock")).status == "READY"
        assert backend.stopped == []


async def test_a_database_error_answers_503_in_the_openai_format(
    catalog: CatalogServer, client: CatalogClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await client.create(MODELS, {"name": "m"})
    _database_blip(monkeypatch, "get", "models")
    url = f"{catalog.url}/v1/workspaces/{WS}/models/m"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        body = await resp.json()
        assert resp.status == 503, body
    assert body["error"]["code"] == "database_unavailable"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    _database_blip(monkeypatch, "get", "models")
    with pytest.raises(CatalogError) as caught:
        await client.get(MODELS, "m")
    assert (caught.value.status, caught.value.code) == (503, "database_unavailable")


async def test_an_error_body_that_is_not_json_is_the_status_catalog_error() -> None:
    """A plain-text error (a proxy's, Starlette's 500) raises the status's CatalogError,
    never a JSONDecodeError, so every caller's `except CatalogError` holds."""

    async def plain(request: web.Request) -> web.Response:
        status = int(request.match_info["name"])
        return web.Response(status=status, text="Internal Server Error")

    app = web.Application()
    app.router.add_route("*", "/v1/workspaces/{ws}/models/{name}", plain)
    server = Server(app, port=0)
    await server.start()
    try:
        async with CatalogClient(server.url, workspace=WS) as plain_client:
            with pytest.raises(CatalogError) as caught:
                await plain_client.get(MODELS, "500")
            assert caught.value.status == 500 and "Internal Server Error" in caught.value.message
            with pytest.raises(NotFoundError):
                await plain_client.update(MODELS, "404", {"description": "x"})
            with pytest.raises(CatalogError) as not_json:
                await plain_client.get(MODELS, "200")
            assert "not JSON" in not_json.value.message
    finally:
        await server.stop()


async def test_only_a_failure_of_the_backend_stops_a_deployment(
    catalog: CatalogServer,
) -> None:
    """Any failure around the backend (here: the client raises a ValueError, as an answer
    it could not decode once did) leaves the deployment's workers running; a backend call
    that fails makes it ERROR with its workers stopped."""

    class PollFails(FakeBackend):
        async def poll(self, deployment: Any) -> Any:
            if deployment.name == "broken":
                raise OSError(7, "Argument list too long")
            return await super().poll(deployment)

    backend = PollFails()
    async with controller_on(catalog.url, workspaces=[WS], backend=backend) as (ctl, client, _):
        for name in ("mock", "broken"):
            await client.create(DEPLOYMENTS, {"name": name, "model": "m", "engine": "mocker"})
        await ctl.step()

        async def garbage(call: str, params: Any) -> None:
            if call == f"PATCH /v1/workspaces/{WS}/deployments/mock":
                raise ValueError("Expecting value: line 1 column 1 (char 0)")

        client.before = garbage
        await ctl.step()
        assert backend.stopped == ["broken"]
        assert (await client.get(DEPLOYMENTS, "mock")).status == "PENDING"
        broken = await client.get(DEPLOYMENTS, "broken")
        assert broken.status == "ERROR" and "Argument list too long" in broken.status_message
        client.before = None
        await ctl.step()
        assert (await client.get(DEPLOYMENTS, "mock")).status == "READY"
        assert backend.stopped == ["broken"]


async def test_a_provider_serving_more_than_its_patch_can_carry_is_error_naming_the_bound(
    catalog: CatalogServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The served_models PATCH of a provider serving thousands of long names was over the
    API's 1 MiB body bound: a 413 only logged, the provider CREATED with no reason and its
    routes without targets. Over `SERVED_MODELS_BYTES` (made small here) it is ERROR naming
    the bound; the other providers are READY."""
    from shoal.catalog import providers as providers_module

    monkeypatch.setattr(providers_module, "SERVED_MODELS_BYTES", 2000, raising=False)
    many = [f"model-{i:03d}-" + "x" * 30 for i in range(60)]  # ~7 KB of served_models
    async with (
        openai_servers(many, ["small"]) as (big, small),
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, _),
    ):
        for name, server in (("big", big), ("small", small)):
            await client.create(PROVIDERS, {"name": name, "type": "url",
                                            "base_url": server.base_url})  # fmt: skip
        await ctl.step()
        assert ctl.last is not None and ctl.last.failed == {}
        over = await client.get(PROVIDERS, "big")
        assert over.status == "ERROR", over.status_message
        assert "SERVED_MODELS_BYTES" in over.status_message and "2000" in over.status_message
        assert over.served_models in (None, [])
        assert (await client.get(PROVIDERS, "small")).status == "READY"


def test_served_models_at_their_bound_fit_the_apis_body_bound() -> None:
    from shoal.catalog.api import MAX_BODY_BYTES
    from shoal.catalog.providers import SERVED_MODELS_BYTES

    entry = {"model_entity": "m" * 200, "served_model_name": "m" * 200}
    count = SERVED_MODELS_BYTES // len(json.dumps(entry, separators=(",", ":")))
    body = {"status": "ERROR", "status_message": "\u00e9" * 4000, "version": 2**62,
            "served_models": [entry] * count}  # fmt: skip
    assert len(json.dumps(body).encode()) < MAX_BODY_BYTES


async def test_a_served_name_with_a_trailing_newline_is_skipped_and_the_provider_is_ready(
    catalog: CatalogServer, caplog: pytest.LogCaptureFixture
) -> None:
    """`re.match` with `$` took "bad\\n" for a valid entity name; the API refused it, so the
    provider's PATCH was a 422 every pass and its good models had routes without targets.
    Now it is skipped, counted in the status and logged once."""
    async with (
        openai_servers(["good-1", "good-2", "bad\n"]) as (server,),
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, store),
    ):
        await client.create(PROVIDERS, {"name": "p", "type": "url",
                                        "base_url": server.base_url})  # fmt: skip
        with caplog.at_level("WARNING", logger="shoal.catalog.providers"):
            await ctl.step()
            await ctl.step()
        provider = await client.get(PROVIDERS, "p")
        assert provider.status == "READY", provider.status_message
        assert "1 name(s) not valid entity names" in provider.status_message
        assert [s.model_entity for s in provider.served_models or ()] == ["good-1", "good-2"]
        route = await store.get(route_key(WS, "good-1"))
        assert route is not None
        assert [t.model for t in decode_route(route.key, route.value).targets] == ["good-1"]
        skipped = [r for r in caplog.records if "not valid entity names" in r.getMessage()]
        assert len(skipped) == 1 and "bad" in skipped[0].getMessage()


async def test_served_names_with_dot_segments_are_skipped_not_retried_every_pass(
    catalog: CatalogServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A listed id such as `a/../b` passed the controller's name check, but the API refuses a
    new resource named so: its entity and its passthrough virtual model were refused every
    pass (two failed calls and two warnings per name, ~15,000 names in a listing within the
    served_models bound), and the provider said it served them. Now they are skipped and
    counted like any invalid name."""
    async with (
        openai_servers(["good", "a/../b", "x/."]) as (server,),
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, _),
    ):
        await client.create(PROVIDERS, {"name": "p", "type": "url",
                                        "base_url": server.base_url})  # fmt: skip
        with caplog.at_level("WARNING"):
            await ctl.step()
            await ctl.step()
        provider = await client.get(PROVIDERS, "p")
        assert provider.status == "READY", provider.status_message
        assert provider.status_message == "1 model(s); 2 name(s) not valid entity names"
        assert [s.model_entity for s in provider.served_models or ()] == ["good"]
        messages = [r.getMessage() for r in caplog.records]
        assert [m for m in messages if "/.." in m or "x/." in m] == [
            "provider team-a/p: 2 served name(s) skipped, not valid entity names: 'a/../b', 'x/.'"
        ]  # logged once, never refused by the API
        assert [m.name for m in await client.list_all(MODELS)] == ["good"]


async def test_a_providers_listing_is_bounded(
    catalog: CatalogServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`GET /models` was read whole and decoded on the event loop, however large. Now: over
    `LISTING_BYTES` or `LISTING_MODELS` (made small here) the provider is ERROR naming the
    bound (how a large listing is decoded: tests/catalog/test_decoded_in_slices.py)."""
    from shoal.catalog import providers as providers_module

    async with (
        openai_servers([f"model-{i:03d}" for i in range(100)]) as (server,),
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, _),
    ):
        await client.create(PROVIDERS, {"name": "p", "type": "url",
                                        "base_url": server.base_url})  # fmt: skip
        monkeypatch.setattr(providers_module, "LISTING_BYTES", 1000, raising=False)
        await ctl.step()
        provider = await client.get(PROVIDERS, "p")
        assert provider.status == "ERROR" and "LISTING_BYTES" in provider.status_message
        monkeypatch.setattr(providers_module, "LISTING_BYTES", 8 << 20)
        monkeypatch.setattr(providers_module, "LISTING_MODELS", 50, raising=False)
        await ctl.step()
        provider = await client.get(PROVIDERS, "p")
        assert provider.status == "ERROR" and "LISTING_MODELS" in provider.status_message
        assert "100 models" in provider.status_message
        monkeypatch.setattr(providers_module, "LISTING_MODELS", 100_000)
        await ctl.step()
        assert (await client.get(PROVIDERS, "p")).status == "READY"


async def test_a_provider_row_the_client_cannot_read_keeps_its_models_routes(
    catalog: CatalogServer, database_url: str
) -> None:
    """A provider row that no longer validates (left by an older catalog) is left as it is,
    and so is what it serves: its passthrough virtual models are not deleted and their
    routes are not rewritten without its targets; the workspace's other provider goes on."""
    await seed_converged(database_url, {"odd": ["m-odd"], "good": ["m-good"]})
    async with (
        openai_servers(["m-odd"], ["m-good"]) as [odd_server, good_server],
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, store),
    ):
        await client.update(PROVIDERS, "odd", {"base_url": odd_server.base_url})
        await client.update(PROVIDERS, "good", {"base_url": good_server.base_url})
        await ctl.step()
        before = await store.get(route_key(WS, "m-odd"))
        assert before is not None and decode_route(before.key, before.value).targets
        engine = open_engine(database_url)  # the row goes bad, as an older catalog left it
        try:
            async with engine.begin() as conn:
                table = PROVIDERS.table
                row = (await conn.execute(
                    table.select().where(table.c.workspace == WS, table.c.name == "odd")
                )).one()  # fmt: skip
                await conn.execute(
                    table.update().where(table.c.id == row.id)
                    .values(data={**row.data, "served_models": "not a list"})
                )  # fmt: skip
        finally:
            await engine.dispose()
        for _ in range(2):
            await ctl.step()
            assert ctl.last is not None and ctl.last.failed == {}
        assert [vm.name for vm in await client.list_all(VIRTUAL_MODELS)] == ["m-good", "m-odd"]
        after = await store.get(route_key(WS, "m-odd"))
        assert after is not None and after.mod_revision == before.mod_revision
        assert (await client.get(MODELS, "m-odd")).providers == [f"{WS}/odd"]
        assert (await client.get(PROVIDERS, "good")).status == "READY"
