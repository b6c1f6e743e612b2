"""Virtual models served by a frontend: routes written straight into the store (as the models
controller writes them), fake workers as fleet models and as `url` providers."""

from __future__ import annotations

import asyncio
import collections
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shoal.discovery import FleetTarget, Route, UrlTarget, delete_route, publish_route, route_key
from shoal.frontend import Frontend
from shoal.frontend.http.request import Request
from shoal.frontend.http.upstream import Upstream
from shoal.frontend.proxy.proxy import Proxy
from shoal.frontend.registry.metrics import FrontendMetrics
from shoal.frontend.registry.registry import Registry
from shoal.frontend.registry.router import make_router
from shoal.frontend.virtual.routes import RouteWatcher
from shoal.frontend.virtual.secrets import SecretError, Secrets, env_name
from shoal.frontend.virtual.targets import UrlChoice
from shoal.frontend.virtual.virtual import RouteTable
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker, openai_client
from tests.frontend.support import FakeWorker, serving
from tests.helpers import free_port, wait_for

CHAT = [{"role": "user", "content": "hi"}]


def route(name: str, *targets: FleetTarget | UrlTarget, workspace: str = "default") -> Route:
    return Route(workspace=workspace, name=name, targets=tuple(targets))


def provider(worker: FakeWorker, model: str | None = None, **kwargs: Any) -> UrlTarget:
    """A `url` target pointing at `worker` over plain HTTP."""
    return UrlTarget(base_url=f"{worker.url}/v1", model=model or worker.model, **kwargs)


async def post(
    frontend: Frontend, body: dict[str, Any] | bytes, **headers: str
) -> tuple[int, Any, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{frontend.url}/v1/chat/completions",
            data=data,
            headers={"content-type": "application/json", **headers},
        ) as response,
    ):
        return response.status, await response.json(), response.headers


async def model_ids(frontend: Frontend) -> list[str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{frontend.url}/v1/models") as response,
    ):
        return [m["id"] for m in (await response.json())["data"]]


async def get_model(frontend: Frontend, name: str) -> tuple[int, str | None]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{frontend.url}/v1/models/{name}") as response,
    ):
        return response.status, (await response.json()).get("id")


def routed(frontend: Frontend, name: str, serving_now: bool = True) -> bool:
    virtual = frontend.routes.models.get(name)
    return virtual is not None and virtual.serving == serving_now


def seen_model(worker: FakeWorker) -> str:
    return str(json.loads(worker.bodies[-1])["model"])


# -- watching the store -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memory", "sqlite", "etcd"])
async def test_a_route_serves_an_alias_and_a_deleted_route_answers_404(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker("mock-llm")
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend))
    await publish_route(store, route("fast", FleetTarget("mock-llm")))
    await wait_for(lambda: routed(frontend, "fast"), message="the route is served")

    reply = await openai_client(frontend).chat.completions.create(
        model="fast", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.model == "mock-llm"  # the worker answered for the name it serves
    assert seen_model(worker) == "mock-llm"
    assert await model_ids(frontend) == ["fast", "mock-llm"]

    await delete_route(store, "default", "fast")
    await wait_for(lambda: "fast" not in frontend.routes.models, message="the route is gone")
    status, body, _ = await post(frontend, {"model": "fast", "messages": CHAT})
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    assert await model_ids(frontend) == ["mock-llm"]


@pytest.mark.parametrize("backend", ["memory", "sqlite", "etcd"])
async def test_a_malformed_route_is_skipped_and_never_hides_a_valid_one(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    await store.put(
        route_key("default", "broken"),
        b'{"workspace": "default", "name": "broken", "targets": [{"kind": "carrier-pigeon"}]}',
    )
    await publish_route(store, route("good", FleetTarget("mock-llm")))
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend) and routed(frontend, "good"))
    assert "broken" not in frontend.routes.models
    assert list(frontend.routes.skipped) == [route_key("default", "broken")]

    # A valid route overwritten with garbage keeps serving until a valid value or a delete.
    await store.put(route_key("default", "good"), b"not json")
    await wait_for(lambda: route_key("default", "good") in frontend.routes.skipped)
    status, body, _ = await post(frontend, {"model": "good", "messages": CHAT})
    assert (status, body["model"]) == (200, "mock-llm")
    async with aiohttp.ClientSession() as session:
        health = await (await session.get(f"{frontend.url}/health")).json()
    reported = {s["key"] for s in health["virtual_models"]["skipped"]}
    assert reported == {route_key("default", "broken"), route_key("default", "good")}

    await store.delete(route_key("default", "good"))
    await wait_for(lambda: "good" not in frontend.routes.models)
    assert route_key("default", "good") not in frontend.routes.skipped


async def test_routes_of_other_workspaces_are_not_served(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    await publish_route(store, route("theirs", FleetTarget("mock-llm"), workspace="team-b"))
    await publish_route(store, route("ours", FleetTarget("mock-llm"), workspace="team-a"))
    frontend = await start_frontend(workspaces=("team-a",))
    await wait_for(lambda: serving(frontend) and routed(frontend, "ours"))
    assert "theirs" not in frontend.routes.models
    status, _, _ = await post(frontend, {"model": "theirs", "messages": CHAT})
    assert status == 404


async def test_the_first_workspace_wins_a_name_both_define(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    first, second = await start_worker("model-a"), await start_worker("model-b")
    await publish_route(store, route("shared", FleetTarget("model-b"), workspace="second"))
    await publish_route(store, route("shared", FleetTarget("model-a"), workspace="first"))
    frontend = await start_frontend(workspaces=("first", "second"))
    await wait_for(lambda: serving(frontend, "model-a") and serving(frontend, "model-b"))
    await wait_for(lambda: routed(frontend, "shared"))
    status, body, _ = await post(frontend, {"model": "shared", "messages": CHAT})
    assert (status, body["model"], first.requests, second.requests) == (200, "model-a", 1, 0)

    await delete_route(store, "first", "shared")
    await wait_for(lambda: frontend.routes.models["shared"].workspace == "second")
    status, body, _ = await post(frontend, {"model": "shared", "messages": CHAT})
    assert (status, body["model"]) == (200, "model-b")


class CompactingStore:
    """A store whose watches can be broken once (`broken`), dropping the event in flight,
    and whose later watches start at the current revision whatever they ask for: history
    compacted while the watcher was away, so only a fresh read tells what changed."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.broken = asyncio.Event()
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[Any]:
        if self.failed:
            start_revision = (await self.inner.get_prefix(prefix)).revision + 1
        async for event in self.inner.watch(prefix, start_revision):
            if self.broken.is_set():
                self.broken.clear()
                self.failed += 1
                raise ConnectionError("injected: the watch broke")
            yield event


@pytest.mark.parametrize("backend", ["memory", "sqlite", "etcd"])
async def test_a_route_deleted_while_the_watch_was_broken_is_removed(store: Store) -> None:
    await publish_route(store, route("a", FleetTarget("model-a")))
    await publish_route(store, route("b", FleetTarget("model-b")))
    flaky = CompactingStore(store)
    table = RouteTable(Registry())
    watcher = RouteWatcher(flaky, table)  # type: ignore[arg-type]
    await watcher.start()
    try:
        assert set(table.models) == {"a", "b"}
        flaky.broken.set()
        await delete_route(store, "default", "a")  # its event is lost with the watch
        await wait_for(lambda: flaky.failed == 1)
        await wait_for(lambda: set(table.models) == {"b"}, message="the re-read removed `a`")
        await publish_route(store, route("c", FleetTarget("model-c")))
        await wait_for(lambda: set(table.models) == {"b", "c"}, message="watching again")
    finally:
        await watcher.stop()
        table.close()


# -- choosing a target ---------------------------------------------------------------------


async def test_targets_share_requests_by_weight_each_seeing_its_own_name(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    heavy, light = await start_worker("model-a"), await start_worker("model-b")
    frontend = await start_frontend()
    await publish_route(
        store, route("split", FleetTarget("model-a", weight=3), FleetTarget("model-b", weight=1))
    )
    await wait_for(lambda: serving(frontend, "model-a") and serving(frontend, "model-b"))
    await wait_for(lambda: routed(frontend, "split"))
    answered: collections.Counter[str] = collections.Counter()
    async with aiohttp.ClientSession() as session:
        for _ in range(400):
            async with session.post(
                f"{frontend.url}/v1/chat/completions", json={"model": "split", "messages": CHAT}
            ) as response:
                assert response.status == 200
                answered[(await response.json())["model"]] += 1
    # 3:1 of 400 is 300:100; the standard deviation is 8.7 requests: allow more than 5.
    assert 255 <= answered["model-a"] <= 345, answered
    assert answered["model-a"] + answered["model-b"] == 400
    assert heavy.requests == answered["model-a"] and light.requests == answered["model-b"]
    assert {json.loads(b)["model"] for b in heavy.bodies} == {"model-a"}
    assert {json.loads(b)["model"] for b in light.bodies} == {"model-b"}


async def test_a_zero_weight_target_gets_nothing_and_a_route_without_targets_is_unlisted(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    used, spare = await start_worker("model-a"), await start_worker("model-b")
    frontend = await start_frontend()
    await publish_route(
        store, route("one", FleetTarget("model-a"), FleetTarget("model-b", weight=0))
    )
    await publish_route(store, route("nowhere"))
    await wait_for(lambda: serving(frontend, "model-a") and serving(frontend, "model-b"))
    await wait_for(lambda: routed(frontend, "one") and routed(frontend, "nowhere", False))
    for _ in range(20):
        status, _, _ = await post(frontend, {"model": "one", "messages": CHAT})
        assert status == 200
    assert (used.requests, spare.requests) == (20, 0)
    assert "nowhere" not in await model_ids(frontend)
    status, body, _ = await post(frontend, {"model": "nowhere", "messages": CHAT})
    assert (status, body["error"]["code"]) == (503, "no_ready_instance")


async def test_a_body_naming_the_served_model_is_forwarded_byte_for_byte(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker("mock-llm")
    frontend = await start_frontend()
    await publish_route(store, route("passthrough", FleetTarget("mock-llm")))
    await publish_route(store, route("alias", FleetTarget("mock-llm")))
    await wait_for(lambda: serving(frontend) and routed(frontend, "alias"))
    await wait_for(lambda: routed(frontend, "passthrough"))
    body = b'{ "model" : "passthrough", "messages": [{"role":"user","content":"1.50e2 \\u00e9"}], "n": 1 }'
    # The name differs: only the top-level `model` is re-encoded, every other member as sent.
    status, _, _ = await post(frontend, body.replace(b"passthrough", b"alias"))
    assert status == 200
    rewritten = json.loads(worker.bodies[-1])
    assert rewritten == {**json.loads(body), "model": "mock-llm"}
    assert b'[{"role":"user","content":"1.50e2 \\u00e9"}]' in worker.bodies[-1]
    # A route to a model of the same name (the controller's passthrough): the very bytes.
    await publish_route(store, route("mock-llm", FleetTarget("mock-llm")))
    await wait_for(lambda: routed(frontend, "mock-llm"))
    same = body.replace(b"passthrough", b"mock-llm")
    status, _, _ = await post(frontend, same)
    assert (status, worker.bodies[-1]) == (200, same)


async def test_a_virtual_model_wins_over_a_discovered_model_of_its_name(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    caplog: pytest.LogCaptureFixture,
) -> None:
    shadowed, target = await start_worker("mock-llm"), await start_worker("other")
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, "mock-llm") and serving(frontend, "other"))
    await publish_route(store, route("mock-llm", FleetTarget("other")))
    await wait_for(lambda: routed(frontend, "mock-llm"))
    for _ in range(3):
        status, body, _ = await post(frontend, {"model": "mock-llm", "messages": CHAT})
        assert (status, body["model"]) == (200, "other")
    assert (shadowed.requests, target.requests) == (0, 3)
    assert await model_ids(frontend) == ["mock-llm", "other"]  # listed once
    clashes = [r for r in caplog.records if "shadows the discovered model" in r.getMessage()]
    assert len(clashes) == 1

    await delete_route(store, "default", "mock-llm")
    await wait_for(lambda: "mock-llm" not in frontend.routes.models)
    status, body, _ = await post(frontend, {"model": "mock-llm", "messages": CHAT})
    assert (status, body["model"], shadowed.requests) == (200, "mock-llm", 1)


async def test_a_fleet_target_follows_the_fleet_model_coming_and_going(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend()
    await publish_route(store, route("later", FleetTarget("model-a")))
    await wait_for(lambda: routed(frontend, "later", False))
    assert "later" not in await model_ids(frontend)
    status, body, _ = await post(frontend, {"model": "later", "messages": CHAT})
    assert (status, body["error"]["code"]) == (503, "no_ready_instance")

    assert await get_model(frontend, "later") == (404, None)
    worker = await start_worker("model-a")
    await wait_for(lambda: serving(frontend, "model-a"))
    assert await model_ids(frontend) == ["later", "model-a"]  # the cached body was rebuilt
    assert await get_model(frontend, "later") == (200, "later")
    status, body, _ = await post(frontend, {"model": "later", "messages": CHAT})
    assert (status, body["model"]) == (200, "model-a")
    await worker.unregister()
    await wait_for(lambda: not serving(frontend, "model-a"))
    assert await model_ids(frontend) == []


async def test_a_fleet_target_retries_and_inhibits_like_the_fleet_model(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    failing, healthy = await start_worker("model-a"), await start_worker("model-a")
    frontend = await start_frontend(router="round-robin")
    await publish_route(store, route("alias", FleetTarget("model-a")))
    await wait_for(lambda: serving(frontend, "model-a", 2) and routed(frontend, "alias"))
    failing.fail_next = 100
    for _ in range(6):
        status, body, _ = await post(frontend, {"model": "alias", "messages": CHAT})
        assert (status, body["model"]) == (200, "model-a")
    assert failing.requests == 1  # failed once, then inhibited
    assert healthy.requests == 6


# -- url targets ---------------------------------------------------------------------------


async def test_a_url_target_gets_the_secret_instead_of_the_clients_authorization(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    remote = await start_worker("remote-model", register=False)
    bare = await start_worker("bare-model", register=False)
    monkeypatch.setenv("SHOAL_SECRET_REMOTE_KEY", "sk-remote")
    frontend = await start_frontend()
    await publish_route(store, route("r", provider(remote, secret="remote-key")))
    await publish_route(store, route("b", provider(bare)))
    await wait_for(lambda: routed(frontend, "r") and routed(frontend, "b"))
    status, body, headers = await post(
        frontend, {"model": "r", "messages": CHAT}, authorization="Bearer client-key"
    )
    assert (status, body["model"]) == (200, "remote-model")
    assert remote.headers[-1].getall("authorization") == ["Bearer sk-remote"]
    assert headers["x-shoal-instance"] == f"url:127.0.0.1:{remote.port}"
    # No secret: the client's key, meant for the gateway, is not passed on either.
    status, _, _ = await post(
        frontend, {"model": "b", "messages": CHAT}, authorization="Bearer client-key"
    )
    assert status == 200
    assert "authorization" not in bare.headers[-1]


async def test_a_url_target_without_its_secret_is_unlisted_until_the_secret_appears(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    tmp_path: Path,
) -> None:
    remote = await start_worker("remote-model", register=False)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    frontend = await start_frontend(secrets_dir=secrets, reconcile_interval=0.1)
    await publish_route(store, route("r", provider(remote, secret="late")))
    await wait_for(lambda: routed(frontend, "r", False))
    error = frontend.routes.describe()["models"][0]["targets"][0]["error"]
    assert "late" in error and str(secrets / "late") in error
    status, _, _ = await post(frontend, {"model": "r", "messages": CHAT})
    assert status == 503
    assert await model_ids(frontend) == []

    (secrets / "late").write_text("sk-late\n")
    await wait_for(lambda: routed(frontend, "r"), message="the secret was picked up")
    assert await model_ids(frontend) == ["r"]
    status, _, _ = await post(frontend, {"model": "r", "messages": CHAT})
    assert status == 200
    assert remote.headers[-1]["authorization"] == "Bearer sk-late"
    (secrets / "late").write_text("sk-rotated")
    await wait_for(
        lambda: (
            frontend.routes.models["r"].choices[0].upstream.authorization == b"Bearer sk-rotated"
        )
    )  # type: ignore[union-attr]


async def test_a_dead_url_target_is_inhibited_and_requests_go_to_the_live_one(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    live = await start_worker("live-model", register=False)
    dead = UrlTarget(base_url=f"http://127.0.0.1:{free_port()}/v1", model="dead-model")
    frontend = await start_frontend(inhibit_seconds=30)
    await publish_route(store, route("split", dead, provider(live)))
    await wait_for(lambda: routed(frontend, "split"))
    for _ in range(10):
        status, body, _ = await post(frontend, {"model": "split", "messages": CHAT})
        assert (status, body["model"]) == (200, "live-model")
    dead_upstream = frontend.routes.models["split"].choices[0].upstream
    assert dead_upstream is not None and dead_upstream.inhibited
    assert live.requests == 10

    await publish_route(store, route("only-dead", dead))
    await wait_for(lambda: routed(frontend, "only-dead"))
    status, body, _ = await post(frontend, {"model": "only-dead", "messages": CHAT})
    assert (status, body["error"]["code"]) == (502, "upstream_error")


async def test_a_url_target_answering_5xx_is_retried_on_another_target(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    flaky = await start_worker("flaky-model", register=False)
    steady = await start_worker("steady-model", register=False)
    flaky.fail_next = 100
    frontend = await start_frontend(inhibit_seconds=30)
    await publish_route(
        store, route("pair", provider(flaky, weight=1000), provider(steady, weight=1))
    )
    await wait_for(lambda: routed(frontend, "pair"))
    for _ in range(5):
        status, body, _ = await post(frontend, {"model": "pair", "messages": CHAT})
        assert (status, body["model"]) == (200, "steady-model")
    assert flaky.requests == 1  # then inhibited, for all its weight
    # The retry named the model as the other target serves it.
    assert [json.loads(b)["model"] for b in steady.bodies] == ["steady-model"] * 5


def test_a_provider_base_url_maps_openai_paths_below_it() -> None:
    proxy = Proxy(Registry(), make_router("round-robin"), FrontendMetrics())
    request = Request(
        b"POST",
        b"/v1/chat/completions",
        [(b"authorization", b"Bearer client-key")],
        b"{}",
        keep_alive=True,
        http11=True,
    )

    def head(url: str) -> bytes:
        target = Upstream(1, url, tls=ssl.create_default_context(), provider=True)
        return proxy.request_head(request, target, request.body)

    assert head("https://api.example.com/v1").startswith(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: api.example.com\r\n"
    )
    assert head("https://g.example.com/v1beta/openai/").startswith(
        b"POST /v1beta/openai/chat/completions "
    )
    assert head("http://h:8080/api/v1").startswith(
        b"POST /api/v1/chat/completions HTTP/1.1\r\nhost: h:8080\r\n"
    )
    assert b"client-key" not in head("https://api.example.com/v1")


# -- secrets -------------------------------------------------------------------------------


def test_secrets_come_from_the_environment_then_the_directory(tmp_path: Path) -> None:
    (tmp_path / "openai-key").write_text("  sk-file\n")
    (tmp_path / "both").write_text("sk-file")
    secrets = Secrets(tmp_path, {"SHOAL_SECRET_BOTH": "sk-env"})
    assert env_name("openai-key") == "SHOAL_SECRET_OPENAI_KEY"
    assert secrets.resolve("openai-key") == "sk-file"
    assert secrets.resolve("both") == "sk-env"
    with pytest.raises(SecretError, match=r"SHOAL_SECRET_MISSING or .*missing"):
        secrets.resolve("missing")


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", ".hidden", ""])
def test_a_secret_name_cannot_reach_outside_the_directory(tmp_path: Path, name: str) -> None:
    with pytest.raises(SecretError, match="not valid"):
        Secrets(tmp_path, {}).resolve(name)


@pytest.mark.parametrize("value", ["sk-1\r\nx-injected: 1", "", "   ", "clé"])
def test_a_secret_value_that_could_break_a_header_is_refused(value: str) -> None:
    with pytest.raises(SecretError, match="visible ASCII"):
        Secrets(None, {"SHOAL_SECRET_K": value}).resolve("k")


async def test_a_virtual_models_request_series_are_kept_while_it_is_routed(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    frontend = await start_frontend()
    await publish_route(store, route("alias", FleetTarget("mock-llm")))
    await wait_for(lambda: serving(frontend) and routed(frontend, "alias"))
    status, _, _ = await post(frontend, {"model": "alias", "messages": CHAT})
    assert status == 200
    frontend.metrics.departed_ttl = -1.0  # anything departed goes at once
    frontend.metrics.drop_departed()
    frontend.metrics.drop_departed()
    assert frontend.metrics.models["alias"].requests[200] == 1
    metrics = frontend.metrics.render().decode()
    assert 'shoal_frontend_live_instances{model="alias"} 1.0' in metrics
    assert 'shoal_frontend_requests_total{model="alias",status="200"} 1.0' in metrics


def test_virtual_model_flags_default_and_fall_back_to_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from shoal.cli.frontend import config_from_args
    from shoal.cli.main import build_parser

    names = ("WORKSPACE", "SECRETS_DIR", "PROVIDER_CA_FILE", "TLS_CERTFILE", "TLS_KEYFILE")
    for name in names:
        monkeypatch.delenv(f"SHOAL_{name}", raising=False)
    config = config_from_args(build_parser().parse_args(["frontend"]))
    assert (config.workspaces, config.secrets_dir, config.provider_ca_file) == (
        ("default",), None, None,
    )  # fmt: skip
    assert (config.tls_certfile, config.tls_keyfile) == (None, None)
    flags = build_parser().parse_args(["frontend", "--workspace", "a", "--workspace", "b"])
    assert config_from_args(flags).workspaces == ("a", "b")
    for name in names:
        monkeypatch.setenv(f"SHOAL_{name}", str(tmp_path / name.lower()))
    monkeypatch.setenv("SHOAL_WORKSPACE", "team-a,team-b")
    config = config_from_args(build_parser().parse_args(["frontend"]))
    assert config.workspaces == ("team-a", "team-b")
    assert (config.secrets_dir, config.provider_ca_file) == (
        tmp_path / "secrets_dir", tmp_path / "provider_ca_file",
    )  # fmt: skip
    assert (config.tls_certfile, config.tls_keyfile) == (
        tmp_path / "tls_certfile", tmp_path / "tls_keyfile",
    )  # fmt: skip


async def test_a_url_target_the_frontend_cannot_use_leaves_the_other_targets_serving(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await start_worker("mock-llm")
    frontend = await start_frontend()
    unusable = [
        UrlTarget(base_url="ftp://files.example.com/v1", model="m"),
        UrlTarget(base_url="https://user:pw@api.example.com/v1", model="m"),
        UrlTarget(base_url="https://api.example.com/v1", model="m", secret="../../etc/passwd"),
    ]
    await publish_route(store, route("mixed", *unusable, FleetTarget("mock-llm")))
    await wait_for(lambda: serving(frontend) and routed(frontend, "mixed"))
    errors = [t["error"] for t in frontend.routes.describe()["models"][0]["targets"][:3]]
    assert "only http" in errors[0]
    assert "credentials belong in a secret" in errors[1]
    assert "pw" not in json.dumps(frontend.routes.describe())  # not in /health, nor in logs
    assert "not valid" in errors[2]
    assert "pw@" not in caplog.text and "***@api.example.com" in caplog.text
    version = frontend.routes.version
    await frontend.routes.refresh_secrets()  # nothing a secret would fix: the table stays as it is
    assert frontend.routes.version == version
    for _ in range(5):
        status, body, _ = await post(frontend, {"model": "mixed", "messages": CHAT})
        assert (status, body["model"]) == (200, "mock-llm")


async def test_credentials_in_a_url_target_of_the_wrong_form_reach_neither_health_nor_logs(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A URL refused for its scheme or its characters was quoted whole in the error (which
    `/health` and the log show): with the credentials it held."""
    await start_worker("mock-llm")
    frontend = await start_frontend()
    unusable = [
        UrlTarget(base_url="htps://svc:hunter2@api.example.com/v1", model="m"),
        UrlTarget(base_url="https://svc:hunter2@api.example.com/v1 ", model="m"),
    ]
    await publish_route(store, route("typo", *unusable, FleetTarget("mock-llm")))
    await wait_for(lambda: serving(frontend) and routed(frontend, "typo"))
    errors = [t["error"] for t in frontend.routes.describe()["models"][0]["targets"][:2]]
    assert "only http" in errors[0] and "api.example.com" in errors[0]
    assert "not a plain ASCII URL" in errors[1]
    assert "hunter2" not in json.dumps(frontend.routes.describe())
    assert "hunter2" not in caplog.text


LOOSE_CREDENTIALS = [
    "http:/svc:hunter2@api.example.com/v1",  # one slash
    "http:svc:hunter2@api.example.com/v1",  # none
    "http:///svc:hunter2@api.example.com/v1",  # three
    "http:\\\\svc:hunter2@api.example.com/v1",  # backslashes
    "//svc:hunter2@api.example.com/v1",  # no scheme
    "https://svc:hun/ter2@api.example.com/v1",  # a password's "/" not percent-encoded
    "https://svc:hun?ter2@api.example.com/v1",  # its "?"
    "https://svc:hun#ter2@api.example.com/v1",  # its "#"
]


async def test_credentials_in_a_url_no_parser_reads_as_such_reach_neither_health_nor_logs(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """`redact_url` hid credentials only after `scheme://` and before the first `/`: a URL
    with one slash, none, three, backslashes or no scheme (each refused: no host), or a
    password holding a raw `/`, `?` or `#` (which ends the authority early), was shown with
    its password in the target's error (`/health`) and the log."""
    from shoal.urls import redact_url

    for url in LOOSE_CREDENTIALS:
        assert "hun" not in redact_url(url) and "ter2" not in redact_url(url), url
    assert redact_url("http://h:8080/v1/@team") == "http://h:8080/v1/@team"
    table = RouteTable(Registry())
    watcher = RouteWatcher(store, table)
    await watcher.start()
    try:
        for n, url in enumerate(LOOSE_CREDENTIALS):
            await publish_route(store, route(f"loose{n}", UrlTarget(base_url=url, model="m")))
        names = {f"loose{n}" for n in range(len(LOOSE_CREDENTIALS))}
        await wait_for(
            lambda: names <= set(table.models) | {k.rpartition("/")[2] for k in table.skipped}
        )
        shown = json.dumps([table.describe(), table.skipped])
        assert "hun" not in shown and "ter2" not in shown, shown
        assert "hun" not in caplog.text and "ter2" not in caplog.text
    finally:
        await watcher.stop()
        table.close()


async def test_a_base_url_with_a_query_is_refused_and_its_query_never_shown(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A base URL's query was silently dropped from every request (`?api-version=` never
    reached the provider) yet quoted whole in a client's 502 ("cannot connect to
    http://...?key=SECRET") and the logs. A route with one is now skipped as malformed, and
    reported with the query as `?***`; the valid route held at the key is kept."""
    await start_worker("mock-llm")
    frontend = await start_frontend()
    await publish_route(store, route("q", FleetTarget("mock-llm")))
    await wait_for(lambda: serving(frontend) and routed(frontend, "q"))
    leaky = UrlTarget(base_url=f"http://127.0.0.1:{free_port()}/v1?key=QUERYSECRET", model="m")
    await publish_route(store, route("q", leaky))
    key = route_key("default", "q")
    await wait_for(lambda: key in frontend.routes.skipped)
    assert "has a query" in frontend.routes.skipped[key] and "?***" in frontend.routes.skipped[key]
    status, body, _ = await post(frontend, {"model": "q", "messages": CHAT})
    assert (status, body["model"]) == (200, "mock-llm")  # the valid route still serves
    assert "QUERYSECRET" not in json.dumps(frontend.routes.describe())
    assert "QUERYSECRET" not in caplog.text


def test_an_upstreams_address_never_shows_its_query() -> None:
    """`address` (in every error message and log line about an instance) kept the query."""
    upstream = Upstream(7, "http://u:pw@127.0.0.1:9/v1?key=QUERYSECRET")
    assert upstream.address == "http://127.0.0.1:9/v1?***"
    with pytest.raises(ValueError, match=r"\?\*\*\*") as refused:
        Upstream(8, "ftp://u:pw@h.example.com/v1?key=QUERYSECRET")
    assert "QUERYSECRET" not in str(refused.value) and "pw" not in str(refused.value)


async def test_a_route_of_more_than_max_targets_is_skipped_and_reported(store: Store) -> None:
    """A route's targets had no bound: one 1 MB value of 8,500 url targets held the event
    loop 316 ms while the frontend made a connection pool for each. Over `MAX_TARGETS` it is
    skipped like any malformed route; at the bound it is served."""
    from shoal.discovery.routes import MAX_TARGETS

    table = RouteTable(Registry())
    at_bound = route("wide", *(FleetTarget(f"m{i}") for i in range(MAX_TARGETS)))
    table.put(at_bound.key, at_bound.to_json())
    assert len(table.models["wide"].choices) == MAX_TARGETS
    over = route("wide", *(FleetTarget(f"m{i}") for i in range(MAX_TARGETS + 1)))
    table.put(over.key, over.to_json())
    assert f"length <= {MAX_TARGETS}" in table.skipped[over.key]
    assert len(table.models["wide"].choices) == MAX_TARGETS  # the valid one is kept


async def test_a_secret_file_that_is_not_utf8_is_its_targets_error_and_rotation_goes_on(
    tmp_path: Path,
) -> None:
    """`Secrets.resolve` raised `UnicodeDecodeError` for a binary secret file (it caught only
    `OSError`): the route vanished unreported, and once a file turned binary, every refresh
    stopped at it, so providers after it never got their rotated secret. Now it is a
    `SecretError` like any unusable secret: the target's error in `/health`, and each secret
    is refreshed alone."""
    (tmp_path / "bad").write_bytes(b"sk-\xff\xfe-binary")
    (tmp_path / "turns").write_text("sk-turns-1")
    (tmp_path / "good").write_text("sk-good-1")
    table = RouteTable(Registry(), secrets=Secrets(tmp_path, environ={}))
    targets = {
        name: UrlTarget(base_url=f"http://127.0.0.1:9/{name}/v1", model="m", secret=name)
        for name in ("bad", "turns", "good")
    }
    for name, target in targets.items():
        value = route(name, target)
        table.put(value.key, value.to_json())
    described = {m["name"]: m for m in table.describe()["models"]}
    assert "not UTF-8" in described["bad"]["targets"][0]["error"]
    assert not described["bad"]["serving"] and described["good"]["serving"]
    (tmp_path / "turns").write_bytes(b"sk-\xff-now-binary")
    (tmp_path / "good").write_text("sk-good-2-rotated")
    (tmp_path / "bad").write_text("sk-bad-fixed")
    await table.refresh_secrets()
    upstream = {name: table.models[name].choices[0].upstream for name in targets}
    assert (
        upstream["good"] is not None
        and upstream["good"].authorization == b"Bearer sk-good-2-rotated"
    )
    assert upstream["turns"] is not None and upstream["turns"].authorization == b"Bearer sk-turns-1"
    assert upstream["bad"] is not None and upstream["bad"].authorization == b"Bearer sk-bad-fixed"
    assert sorted(held for _, held in table._upstreams.values()) == [1, 1, 1]  # none leaked
    (tmp_path / "big").write_bytes(b"a" * (64 * 1024 + 1))
    with pytest.raises(SecretError, match="over 65536 bytes"):
        Secrets(tmp_path, environ={}).resolve("big")
    table.close()


class Turns:
    """Counts the turns of the event loop while it runs (a task that yields each turn)."""

    def __init__(self) -> None:
        self.count = 0
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.count += 1

    def stop(self) -> int:
        self._task.cancel()
        return self.count


async def test_a_replace_of_many_routes_lets_the_loop_run_between_slices() -> None:
    """`replace` (a first read, a resync) put every route in one go: 10,000 routes held the
    loop 212-429 ms. Now the loop turns every `SLICE_ROUTES` routes or `SLICE_BYTES` of
    values: counted here in turns of the loop, for many small routes and a few wide ones."""
    from shoal.discovery.routes import MAX_TARGETS
    from shoal.frontend.virtual.virtual import SLICE_ROUTES
    from shoal.store import KeyValue

    def items(routes: list[Route]) -> list[KeyValue]:
        return [KeyValue(r.key, r.to_json(), 1, 1, 0) for r in routes]

    table = RouteTable(Registry())
    small = items([route(f"vm{i}", FleetTarget(f"m{i}")) for i in range(10 * SLICE_ROUTES)])
    turns = Turns()
    await table.replace("default", small)
    assert turns.stop() >= 9 and len(table.models) == 10 * SLICE_ROUTES
    wide = [
        route(f"wide{n}", *(UrlTarget(base_url=f"https://h{i}.example.com/v1", model=f"m{i}")
                            for i in range(MAX_TARGETS)))
        for n in range(4)
    ]  # fmt: skip
    turns = Turns()
    await table.replace("default", items(wide))  # (the small routes go, sliced too)
    assert turns.stop() >= 4 + 9 and sorted(table.models) == [f"wide{n}" for n in range(4)]
    table.close()


async def test_health_describes_at_most_a_hundred_virtual_models_and_counts_them_all() -> None:
    """`describe` (`/health`, the dashboard) listed every route and target: 10,000 routes
    built 1.4 MB on the loop per call. Now the first `DESCRIBED` by name, and a total."""
    from shoal.frontend.virtual.virtual import DESCRIBED

    table = RouteTable(Registry())
    for i in range(DESCRIBED * 3):
        value = route(f"vm{i:04d}", FleetTarget(f"m{i}"))
        table.put(value.key, value.to_json())
    described = table.describe()
    assert described["models_total"] == DESCRIBED * 3
    assert [m["name"] for m in described["models"]] == [f"vm{i:04d}" for i in range(DESCRIBED)]


async def test_health_describes_the_first_targets_of_a_wide_route_and_counts_them_all() -> None:
    """`describe` (`/health`, each dashboard read) described every target of every route it
    listed: 100 routes of `MAX_TARGETS` targets made 7 MB of JSON in one turn of the loop
    (43-81 ms). Now the first `DESCRIBED_TARGETS` of each, in its route's order, and a total."""
    from shoal.discovery.routes import MAX_TARGETS
    from shoal.frontend.virtual.virtual import DESCRIBED_TARGETS

    table = RouteTable(Registry())
    wide = route("wide", *(UrlTarget(base_url=f"https://h{i}.example.com/v1", model=f"m{i}")
                           for i in range(MAX_TARGETS)))  # fmt: skip
    narrow = route("narrow", FleetTarget("a"), FleetTarget("b"))
    for value in (wide, narrow):
        table.put(value.key, value.to_json())
    described = {m["name"]: m for m in table.describe()["models"]}
    assert described["wide"]["targets_total"] == MAX_TARGETS
    shown = [t["model"] for t in described["wide"]["targets"]]
    assert shown == [f"m{i}" for i in range(DESCRIBED_TARGETS)]
    assert described["narrow"]["targets_total"] == 2
    assert [t["model"] for t in described["narrow"]["targets"]] == ["a", "b"]
    table.close()


async def test_secret_files_are_read_off_the_event_loop_when_refreshed(tmp_path: Path) -> None:
    """`refresh_secrets` read every secret file on the loop (3,000 files: 129 ms); now in a
    thread, and the loop only swaps the values."""
    import threading

    loop_thread = threading.get_ident()
    readers: list[int] = []

    class Recorded(Secrets):
        def resolve(self, name: str) -> str:
            readers.append(threading.get_ident())
            return super().resolve(name)

    for i in range(20):
        (tmp_path / f"s{i}").write_text(f"sk-{i}")
    table = RouteTable(Registry(), secrets=Recorded(tmp_path, environ={}))
    value = route("many", *(UrlTarget(base_url="https://h.example.com/v1", model=f"m{i}",
                                      secret=f"s{i}") for i in range(20)))  # fmt: skip
    table.put(value.key, value.to_json())
    readers.clear()
    await table.refresh_secrets()
    assert len(readers) == 20 and loop_thread not in readers
    table.close()


def test_targets_on_one_key_share_it_and_routes_deleted_leave_no_key_behind() -> None:
    """A 401 inhibits every target on the refused key (`UrlChoice.on_key`): the targets at
    one base URL with one secret share one set of upstreams, whatever model or route they
    serve; another secret or another base URL is another key; a deleted route takes its
    upstreams out of the set, and the last one the key."""
    table = RouteTable(Registry(), secrets=Secrets(None, environ={"SHOAL_SECRET_K": "sk-k",
                                                                 "SHOAL_SECRET_J": "sk-j"}))  # fmt: skip

    def at(base: str, model: str, secret: str) -> UrlTarget:
        return UrlTarget(base_url=f"https://{base}.example.com/v1", model=model, secret=secret)

    first = route("first", at("p", "m1", "k"), at("p", "m2", "k"))
    second = route("second", at("p", "m1", "k"), at("p", "m3", "j"), at("q", "m1", "k"))
    for value in (first, second):
        table.put(value.key, value.to_json())
    a, b = table.models["first"].choices
    c, d, e = table.models["second"].choices
    assert isinstance(a, UrlChoice) and isinstance(c, UrlChoice)
    assert a.on_key is b.on_key is c.on_key and a.upstream is c.upstream
    assert set(a.on_key) == {a.upstream, b.upstream}  # type: ignore[union-attr]
    assert set(d.on_key) == {d.upstream} and set(e.on_key) == {e.upstream}  # type: ignore[union-attr]
    table.delete(first.key)
    assert set(c.on_key) == {c.upstream}
    table.delete(second.key)
    assert table._keys == {} and table._upstreams == {}
    table.close()


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_a_burst_of_route_events_lets_the_loop_run_between_slices(store: Store) -> None:
    """The watch applied every event of a burst in one go (the store hands a batch of events
    over without a wait): 10,000 routes written at once held the loop 130-280 ms a step, and
    the gateway's `/live` 0.9-1.8 s. Now it turns every `SLICE_ROUTES` routes or
    `SLICE_BYTES` of values, as `replace` does: counted in turns of the loop."""
    from shoal.discovery.routes import MAX_TARGETS
    from shoal.frontend.virtual.virtual import SLICE_ROUTES

    table = RouteTable(Registry())
    watcher = RouteWatcher(store, table)
    await watcher.start()
    try:
        small = [route(f"vm{i}", FleetTarget(f"m{i}")) for i in range(10 * SLICE_ROUTES)]
        wide = [
            route(f"wide{n}", *(UrlTarget(base_url=f"https://h{i}.example.com/v1", model=f"m{i}")
                                for i in range(MAX_TARGETS)))
            for n in range(4)
        ]  # fmt: skip
        for batch, slices in ((small, 9), (wide, 3)):
            await store.put_many([(r.key, r.to_json()) for r in batch])
            turns = Turns()
            await wait_for(lambda b=batch: all(r.name in table.models for r in b))  # type: ignore[misc]
            assert turns.stop() >= slices
    finally:
        await watcher.stop()
        table.close()


async def test_a_models_listing_of_many_virtual_models_is_made_a_slice_per_turn_of_the_loop(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """`/v1/models` made its listing again, whole, in the request's turn of the loop after
    every change of the registry or the routes: 10,000 virtual models held the gateway's
    loop 14 ms (single targets) to 111 ms (`/live` measured; wide routes) per change, for any
    caller. Now `LISTING_SLICE` models a turn; callers meanwhile wait for the same one."""
    from shoal.frontend import listings
    from tests.helpers import LoopTurns

    await start_worker("mock-llm")
    frontend = await start_frontend()
    count = 4 * listings.LISTING_SLICE
    virtual = [route(f"vm{i:05d}", FleetTarget("mock-llm")) for i in range(count)]
    await store.put_many([(r.key, r.to_json()) for r in virtual])
    await wait_for(lambda: serving(frontend) and len(frontend.routes.models) == count)
    versions = (frontend.registry.version, frontend.routes.version)
    made = LoopTurns().wrap(listings.Listings, "virtual_object")
    try:
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(
                *(session.get(f"{frontend.url}/v1/models") for _ in range(3))
            )
            bodies = [await answer.json() for answer in answers]
    finally:
        await made.stop()
    assert all(len(body["data"]) == count + 1 for body in bodies)
    assert bodies[0]["data"][0]["id"] == "mock-llm" and bodies[0]["data"][1]["id"] == "vm00000"
    if (frontend.registry.version, frontend.routes.version) == versions:  # (nothing moved)
        assert sum(made.per_turn.values()) == count  # (one listing made for the three callers)
    assert made.most_per_turn <= listings.LISTING_SLICE, made.most_per_turn


async def test_a_models_listing_that_failed_is_made_anew_by_the_next_caller(
    start_worker: StartWorker, start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing is made once for every caller of a version: one that failed (a bug) must
    not answer every later caller of that version with its error."""
    from shoal.frontend import listings

    await start_worker("mock-llm")
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend))
    real = listings.Listings.model_object
    failures = [1]

    def failing_once(self: listings.Listings, model: Any) -> dict[str, Any]:
        if failures:
            failures.pop()
            raise RuntimeError("a bug")
        return real(self, model)

    monkeypatch.setattr(listings.Listings, "model_object", failing_once)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{frontend.url}/v1/models") as first:
            assert first.status == 503
        async with session.get(f"{frontend.url}/v1/models") as second:
            assert second.status == 200
            assert [m["id"] for m in (await second.json())["data"]] == ["mock-llm"]
