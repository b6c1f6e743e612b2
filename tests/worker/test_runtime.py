"""The worker runtime in process: registration, metadata hosting, adapters, lease loss, drain."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from shoal.cards import ModelCard, ModelType
from shoal.discovery import Discovery, EndpointId, ModelKey
from shoal.store import Store, open_store
from shoal.worker import Engine, Runtime, ServedModel
from shoal.worker import endpoint as endpoint_module
from shoal.worker import health as health_module
from shoal.worker.engines.mocker import MockerEngine
from shoal.worker.metadata import MetadataKey
from tests.helpers import wait_for
from tests.worker.support import raw_get

MODEL = "mock-model"
EP = "ns.backend.generate"


@pytest.fixture
def store_url() -> str:
    return f"memory://{uuid.uuid4().hex}"


@pytest.fixture
def observer(store: Store) -> Store:
    """A second client of the same store (the worker tests' `store`, here on `memory://`):
    what the rest of the fleet sees."""
    return store


@pytest.fixture
async def runtime(store_url: str) -> AsyncIterator[Runtime]:
    rt = Runtime(store_url, lease_ttl=0.6, admin_token="s3cret", drain_timeout=5)
    await rt.start()
    yield rt
    await rt.drain(timeout=1)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def serve_mocker(runtime: Runtime, **kwargs: Any) -> MockerEngine:
    engine = MockerEngine(MODEL, **kwargs)
    await runtime.endpoint(EP).serve(engine)
    return engine


AUTH = {"Authorization": "Bearer s3cret"}


async def long_stream(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    """A streamed chat of 100 tokens to the endpoint at `url`, its response still open."""
    return await http.post(
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 100,
            "stream": True,
        },
    )


async def listed(observer: Store) -> dict[str, Any]:
    return {m.card.display_name: m for m in await Discovery(observer).list()}


async def test_served_engine_is_listed_with_its_url_and_verifiable_metadata(
    runtime: Runtime, observer: Store, http: aiohttp.ClientSession
) -> None:
    await serve_mocker(runtime, speedup=0)
    models = await listed(observer)

    model = models[MODEL]
    assert model.instance_id == runtime.instance_id
    assert model.url == runtime.endpoint(EP).url
    assert model.instance.status_url == runtime.status_url
    assert set(model.card.metadata_files) == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    for name, meta in model.card.metadata_files.items():
        assert meta.url == (
            f"{runtime.status_url}/v1/metadata/ns/backend/generate/mock-model/_/{name}"
        )
        async with http.get(meta.url) as resp:
            assert resp.status == 200
            body = await resp.read()
        hosted = runtime.metadata.lookup(
            MetadataKey.of(EndpointId.parse(EP), "mock-model", None, name)
        )
        assert hosted == body and len(body) == meta.size
        assert meta.checksum == f"sha256:{hashlib.sha256(body).hexdigest()}"


async def test_detaching_an_adapter_404s_its_files_while_the_base_model_still_serves(
    runtime: Runtime, observer: Store, http: aiohttp.ClientSession
) -> None:
    await serve_mocker(runtime, speedup=0)
    async with http.post(
        runtime.status_url + "/v1/loras", json={"name": "my-lora", "path": "/a/b"}, headers=AUTH
    ) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["suffix"] == "my-lora"
    models = await listed(observer)
    adapter = models["my-lora"]
    assert adapter.key.suffix == "my-lora" and adapter.card.lora is not None
    assert adapter.card.lora.base_model == MODEL
    assert "adapter_config.json" in adapter.card.metadata_files
    async with http.post(
        f"{runtime.endpoint(EP).url}/v1/chat/completions",
        json={"model": "my-lora", "messages": [{"role": "user", "content": "x"}]},
    ) as resp:
        assert resp.status == 200

    async with http.delete(runtime.status_url + "/v1/loras/my-lora", headers=AUTH) as resp:
        assert resp.status == 200
    assert set(await listed(observer)) == {MODEL}
    for meta in adapter.card.metadata_files.values():
        async with http.get(meta.url) as resp:
            assert resp.status == 404
    for meta in models[MODEL].card.metadata_files.values():
        async with http.get(meta.url) as resp:
            assert resp.status == 200
    async with http.delete(runtime.status_url + "/v1/loras/my-lora", headers=AUTH) as resp:
        assert resp.status == 404


async def test_a_thousand_attach_detach_cycles_leave_the_registry_at_its_starting_size(
    runtime: Runtime, observer: Store, tmp_path: Path
) -> None:
    await serve_mocker(runtime, speedup=0)
    endpoint = runtime.endpoint(EP)
    start = len(runtime.metadata)
    (tmp_path / "adapter_config.json").write_text("{}")
    files = {"adapter_config.json": tmp_path / "adapter_config.json"}
    card = ModelCard.build(
        display_name="cycled",
        slug="cycled",
        source="test://cycled",
        model_types=["chat"],
        context_length=1024,
        lora={"base_model": MODEL, "adapter": "cycled"},
    )
    for _ in range(1000):
        await endpoint.attach_model(card, "cycled", files=files)
        await endpoint.detach_model("cycled")
    assert len(runtime.metadata) == start
    assert set(await listed(observer)) == {MODEL}


async def test_lora_changes_need_the_admin_token(
    runtime: Runtime, http: aiohttp.ClientSession
) -> None:
    await serve_mocker(runtime, speedup=0)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        async with http.post(
            runtime.status_url + "/v1/loras", json={"name": "x", "path": "y"}, headers=headers
        ) as resp:
            assert resp.status == 401
            error = (await resp.json())["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
        async with http.delete(runtime.status_url + "/v1/loras/x", headers=headers) as resp:
            assert resp.status == 401
    async with http.post(
        runtime.status_url + "/v1/loras", json={"name": "x"}, headers=AUTH
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "path"


@pytest.mark.parametrize(
    "raw_path",
    [
        "/v1/metadata/ns/backend/generate/mock-model/_/../../../../etc/passwd",
        "/v1/metadata/ns/backend/generate/mock-model/_/..",
        "/v1/metadata/ns/backend/generate/mock-model/..%2F..%2Fsecret.txt/config.json",
        "/v1/metadata/ns/backend/generate/mock-model/_/..%2Fsecret.txt",
        "/v1/metadata/ns/backend/generate/mock-model/_/%2Fetc%2Fpasswd",
        "/v1/metadata/ns/backend/generate/mock-model/_/config.json%00.txt",
        "/v1/metadata/ns/backend/generate/mock-model/_/%00",
        "/v1/metadata/ns/backend/generate/mock-model/_//etc/passwd",
        "/v1/metadata/ns/backend/generate/mock-model/_/secret.txt",
        "/v1/metadata/ns/backend/generate/mock-model/my-lora/config.json",
        "/v1/metadata/ns/backend/other/mock-model/_/config.json",
        "/v1/metadata/ns/backend/generate/mock-model/_/config.json/extra",
        "/v1/metadata/ns/backend/generate/%2E%2E/_/config.json",
    ],
)
async def test_metadata_paths_outside_the_registry_are_refused_and_read_nothing(
    runtime: Runtime, raw_path: str
) -> None:
    engine = await serve_mocker(runtime, speedup=0)
    base_dir = (await engine.served_models())[0].metadata_dir
    assert base_dir is not None
    (base_dir / "secret.txt").write_text("TOP-SECRET")
    (base_dir.parent / "secret.txt").write_text("TOP-SECRET")

    status, body = await raw_get(runtime.status_url, raw_path)
    assert status in (400, 404), (status, body)
    assert b"TOP-SECRET" not in body and b"root:" not in body


async def test_registered_metadata_file_is_served_over_raw_http(runtime: Runtime) -> None:
    await serve_mocker(runtime, speedup=0)
    status, body = await raw_get(
        runtime.status_url, "/v1/metadata/ns/backend/generate/mock-model/_/config.json"
    )
    assert status == 200 and b"MockerForCausalLM" in body


async def test_lost_lease_is_replaced_and_everything_re_registered_without_restart(
    runtime: Runtime, observer: Store, http: aiohttp.ClientSession
) -> None:
    await serve_mocker(runtime, ttft_ms=0, itl_ms=20)
    async with http.post(
        runtime.status_url + "/v1/loras", json={"name": "my-lora", "path": "/a"}, headers=AUTH
    ) as resp:
        assert resp.status == 200
    old_id = runtime.instance_id
    endpoint = runtime.endpoint(EP)
    assert set(await listed(observer)) == {MODEL, "my-lora"}
    stream = await long_stream(http, endpoint.url)

    assert runtime.store is not None
    runtime.store.set_unreachable(True)
    await wait_for(lambda: _empty(observer), timeout=5, message="keys gone with the lease")
    async with http.get(runtime.status_url + "/health") as resp:
        assert resp.status == 503
        assert any("lease" in r for r in (await resp.json())["reasons"])
    runtime.store.set_unreachable(False)

    models = await wait_for(lambda: _both_back(observer), timeout=5)
    new_id = runtime.instance_id
    assert new_id != old_id
    assert {m.instance_id for m in models.values()} == {new_id}
    assert runtime.metadata.files_of(ModelKey(EndpointId.parse(EP), old_id)) == []
    assert runtime.metadata.files_of(ModelKey(EndpointId.parse(EP), new_id))
    for model in models.values():
        for meta in model.card.metadata_files.values():
            async with http.get(meta.url) as resp:
                assert resp.status == 200
    await wait_for(lambda: _healthy(http, runtime), timeout=5)

    body = (await stream.read()).decode()
    assert body.endswith("data: [DONE]\n\n") and body.count('"content"') == 101


async def test_metrics_registry_counts_the_lease_replacement_and_the_models_re_announced(
    runtime: Runtime, observer: Store
) -> None:
    await serve_mocker(runtime, speedup=0)
    metrics = runtime.metrics_registry
    attached = {"endpoint": EP}
    assert metrics.get_sample_value("shoal_worker_lease_grants_total") == 1
    assert metrics.get_sample_value("shoal_worker_models_attached", attached) == 1
    await wait_for(lambda: metrics.get_sample_value("shoal_worker_lease_held") == 1, timeout=5)

    assert runtime.store is not None
    runtime.store.set_unreachable(True)
    await wait_for(lambda: _empty(observer), timeout=5, message="keys gone with the lease")
    await wait_for(lambda: metrics.get_sample_value("shoal_worker_lease_held") == 0, timeout=5)
    runtime.store.set_unreachable(False)

    await wait_for(lambda: metrics.get_sample_value("shoal_worker_lease_held") == 1, timeout=5)
    assert metrics.get_sample_value("shoal_worker_lease_grants_total") == 2
    assert metrics.get_sample_value("shoal_worker_models_attached", attached) == 1
    assert [m.instance_id for m in (await listed(observer)).values()] == [runtime.instance_id]


async def _empty(store: Store) -> bool:
    return not await Discovery(store).list()


async def _both_back(store: Store) -> dict[str, Any] | None:
    models = await listed(store)
    return models if set(models) == {MODEL, "my-lora"} else None


async def _healthy(http: aiohttp.ClientSession, runtime: Runtime) -> bool:
    async with http.get(runtime.status_url + "/health") as resp:
        return resp.status == 200


class Switchable(Engine):
    """An engine whose served models a test switches on and off."""

    name = "switchable"

    def __init__(self) -> None:
        self.models = [ServedModel(name="a", source="test://a")]
        self.healthy = True

    def app(self) -> web.Application:
        return web.Application()

    async def served_models(self) -> list[ServedModel]:
        return list(self.models)

    async def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("upstream down")


async def test_models_follow_what_the_engine_serves(runtime: Runtime, observer: Store) -> None:
    engine = Switchable()
    await runtime.endpoint(EP).serve(engine)
    assert set(await listed(observer)) == {"a"}

    engine.models = []
    await wait_for(lambda: _empty(observer), timeout=5, message="model a withdrawn")
    engine.models = [ServedModel(name="b", source="test://b", model_types=(ModelType.CHAT,))]
    await wait_for(lambda: _names(observer, {"b"}), timeout=5, message="model b announced")


async def _names(store: Store, names: set[str]) -> bool:
    return set(await listed(store)) == names


async def test_health_is_503_with_the_reason_when_an_engine_is_unhealthy(
    runtime: Runtime, http: aiohttp.ClientSession
) -> None:
    engine = Switchable()
    await runtime.endpoint(EP).serve(engine)
    async with http.get(runtime.status_url + "/health") as resp:
        assert resp.status == 200
        body = await resp.json()
        assert body["endpoints"][0]["models"][0]["name"] == "a"
    engine.healthy = False
    async with http.get(runtime.status_url + "/health") as resp:
        assert resp.status == 503
        assert any("upstream down" in r for r in (await resp.json())["reasons"])


async def test_health_is_503_until_the_first_models_are_announced(
    runtime: Runtime, observer: Store, http: aiohttp.ClientSession
) -> None:
    """What was wrong: an endpoint counted as serving from the moment its port was open,
    before its instance and models were in the store: while the first announcement ran (20,000
    adapters: seconds) /health answered 200, so a rolling update took the new worker as ready
    and stopped an old one before a frontend could route to the new. What holds now: /health
    is 503 ("announcing its models") until they are in the store, and (a process serving no
    endpoint yet) before the first endpoint serves."""
    async with http.get(runtime.status_url + "/health") as resp:
        assert resp.status == 503
        assert (await resp.json())["reasons"] == ["no endpoint is served yet"]
    assert runtime.store is not None
    put_many = runtime.store.put_many
    release = asyncio.Event()

    async def held(*args: Any, **kwargs: Any) -> int:
        await release.wait()
        return await put_many(*args, **kwargs)

    runtime.store.put_many = held  # type: ignore[method-assign]
    serving = asyncio.create_task(runtime.endpoint(EP).serve(Switchable()))
    await wait_for(lambda: runtime.endpoint(EP).url is not None, message="port open")
    async with http.get(runtime.status_url + "/health") as resp:
        assert resp.status == 503
        assert (await resp.json())["reasons"] == [f"endpoint {EP} is announcing its models"]
    assert not await listed(observer)
    release.set()
    await serving
    await wait_for(lambda: _healthy(http, runtime), timeout=5, message="healthy once announced")
    assert set(await listed(observer)) == {"a"}


async def test_a_store_blink_while_an_endpoint_starts_is_retried_not_fatal(
    runtime: Runtime, observer: Store, http: aiohttp.ClientSession
) -> None:
    """What was wrong: a store outage while an endpoint registered its instance or announced
    its first models failed `serve` (`shoal worker`: "cannot serve", exit 1), though the
    lease was held and the loops that repair both were running: a worker started during an
    etcd leader election died. What holds now: `serve` returns, /health says what is not
    announced yet, and the lease loop and the models loop put the instance and the models
    in the store once it answers."""
    store = runtime.store
    assert store is not None
    store.set_unreachable(True)
    endpoint = runtime.endpoint(EP)
    await endpoint.serve(Switchable())  # (the store down: no exception)
    async with http.get(runtime.status_url + "/health") as resp:
        assert resp.status == 503
        assert f"endpoint {EP} is announcing its models" in (await resp.json())["reasons"]
    store.set_unreachable(False)
    await wait_for(lambda: _names(observer, {"a"}), timeout=10, message="announced once back")
    await wait_for(lambda: _healthy(http, runtime), timeout=10, message="healthy once back")
    instances = await Discovery(observer).list_instances()
    assert [i.url for i in instances] == [endpoint.url]


async def test_health_is_503_while_an_endpoint_announces_no_model(
    runtime: Runtime, observer: Store, http: aiohttp.ClientSession
) -> None:
    """What was wrong: an endpoint whose engine listed no model, or only models that were
    refused, was 200 once its (empty) sync ended: a worker no frontend can route to, taken
    as ready by a rolling update. What holds now: 503 naming why (none listed, or how many
    refused) until a model is announced."""
    engine = Switchable()
    engine.models = []
    await runtime.endpoint(EP).serve(engine)
    async with http.get(runtime.status_url + "/health") as resp:
        assert resp.status == 503
        assert (await resp.json())["reasons"] == [
            f"endpoint {EP} announces no model (its engine lists none)"
        ]
    engine.models = [ServedModel(name="z" * 600, source="test://z")]  # (its card is refused)
    await wait_for(lambda: bool(runtime.endpoint(EP).refused), timeout=5, message="refused")
    async with http.get(runtime.status_url + "/health") as resp:
        assert resp.status == 503
        assert (await resp.json())["reasons"] == [
            f"endpoint {EP} announces no model (the 1 its engine lists were refused)"
        ]
    engine.models = [ServedModel(name="a", source="test://a")]
    await wait_for(lambda: _healthy(http, runtime), timeout=5, message="healthy once announced")
    assert set(await listed(observer)) == {"a"}


async def test_a_card_whose_put_answer_was_lost_is_withdrawn_not_left_announced(
    runtime: Runtime, observer: Store
) -> None:
    """What was wrong: an attach whose put the store applied but whose answer was lost (a
    timeout, a blink) left the model unattached, the card in the store under the live
    lease, and nothing to withdraw it (attach_many makes such keys withdrawals pending;
    attach did not, and dropped one pending for its key): frontends routed to a model the
    worker did not serve until the process ended. What holds now: it is withdrawn."""
    from shoal.store import StoreUnavailableError

    engine = Switchable()
    endpoint = runtime.endpoint(EP)
    await endpoint.serve(engine)
    store = runtime.store
    assert store is not None
    create = store.create

    async def applied_then_lost(*args: Any, **kwargs: Any) -> bool:
        await create(*args, **kwargs)
        raise StoreUnavailableError("the answer was lost (test)")

    store.create = applied_then_lost  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailableError):
        await endpoint.attach_served(_adapter("b"))
    store.create = create  # type: ignore[method-assign]
    assert "b" not in endpoint.models
    await wait_for(lambda: _names(observer, {"a"}), timeout=5, message="b withdrawn")


async def test_health_names_an_engine_check_that_never_answers(
    runtime: Runtime, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A health check that hangs is reported as what it is (it read "engine ... unhealthy: ",
    the empty text of a TimeoutError)."""
    engine = Switchable()
    await runtime.endpoint(EP).serve(engine)
    monkeypatch.setattr(health_module, "ENGINE_CHECK_TIMEOUT", 0.1)
    monkeypatch.setattr(engine, "check_health", asyncio.Event().wait)
    async with http.get(runtime.status_url + "/health") as resp:
        assert resp.status == 503
        reasons = (await resp.json())["reasons"]
    assert reasons == [f"endpoint {EP}: engine switchable did not answer its check within 0.1s"]


async def test_drain_taints_waits_for_in_flight_requests_then_withdraws_everything(
    store_url: str, observer: Store, http: aiohttp.ClientSession
) -> None:
    runtime = Runtime(store_url, lease_ttl=5)
    await runtime.start()
    await serve_mocker(runtime, ttft_ms=0, itl_ms=10)
    url = runtime.endpoint(EP).url
    stream = await long_stream(http, url)
    drain = asyncio.create_task(runtime.drain(timeout=10))

    tainted = await wait_for(lambda: listed(observer), message="still listed while draining")
    await wait_for(lambda: _tainted(observer), message="model tainted draining")
    assert MODEL in tainted
    async with http.get(runtime.status_url + "/live") as resp:
        assert resp.status == 503
    body = (await stream.read()).decode()
    assert body.endswith("data: [DONE]\n\n") and body.count('"content"') == 101
    await drain
    assert await Discovery(observer).list() == []
    assert (await observer.get_prefix("shoal/v1/")).items == []
    assert len(runtime.metadata) == 0


async def _tainted(store: Store) -> bool:
    models = await Discovery(store).list()
    return bool(models) and all("draining" in m.card.taints for m in models)


async def test_an_attach_the_store_refuses_hosts_nothing_and_the_base_model_keeps_serving(
    runtime: Runtime, observer: Store, http: aiohttp.ClientSession
) -> None:
    await serve_mocker(runtime, speedup=0)
    base = (await listed(observer))[MODEL]
    store = runtime.store
    assert store is not None
    store.set_unreachable(True)
    try:
        async with http.post(
            runtime.status_url + "/v1/loras",
            json={"name": "my-lora", "path": "/a/b"},
            headers=AUTH,
        ) as resp:
            assert resp.status >= 500  # refused, and said so
    finally:
        store.set_unreachable(False)
    adapter_file = MetadataKey.of(EndpointId.parse(EP), "my-lora", "my-lora", "adapter_config.json")
    assert runtime.metadata.lookup(adapter_file) is None  # its files were rolled back
    assert "my-lora" not in runtime.endpoint(EP).models
    assert set(await listed(observer)) == {MODEL}
    for meta in base.card.metadata_files.values():
        async with http.get(meta.url) as resp:
            assert resp.status == 200


async def test_two_endpoints_of_one_process_serving_one_slug_keep_their_own_files(
    runtime: Runtime, observer: Store, http: aiohttp.ClientSession
) -> None:
    await runtime.endpoint("ns.backend.generate").serve(MockerEngine(MODEL, speedup=0))
    await runtime.endpoint("ns.other.generate").serve(MockerEngine(MODEL, speedup=0))
    cards = {str(m.key.endpoint): m.card for m in await Discovery(observer).list()}
    assert set(cards) == {"ns.backend.generate", "ns.other.generate"}
    urls = {ep: {f.url for f in card.metadata_files.values()} for ep, card in cards.items()}
    assert urls["ns.backend.generate"].isdisjoint(urls["ns.other.generate"])
    await runtime.endpoint("ns.other.generate").close()
    assert {str(m.key.endpoint) for m in await Discovery(observer).list()} == {
        "ns.backend.generate"
    }
    for url in urls["ns.backend.generate"]:
        async with http.get(url) as resp:
            assert resp.status == 200  # the other endpoint's detach left these alone
    for url in urls["ns.other.generate"]:
        async with http.get(url) as resp:
            assert resp.status == 404


async def test_a_drain_whose_taint_the_store_refused_taints_again_and_still_withdraws(
    store_url: str, observer: Store, http: aiohttp.ClientSession
) -> None:
    """A store that comes back during a drain: the worker taints itself as soon as it can
    (frontends stop sending), and after waiting out its requests it still has the cleanup
    budget to withdraw: the wait does not spend it."""
    runtime = Runtime(store_url, lease_ttl=30)
    await runtime.start()
    await serve_mocker(runtime, ttft_ms=0, itl_ms=30)  # a 100-token stream: about 3 s
    stream = await long_stream(http, runtime.endpoint(EP).url)
    store = runtime.store
    assert store is not None
    store.set_unreachable(True)
    drain = asyncio.create_task(runtime.drain(timeout=10))
    await wait_for(lambda: runtime.draining, message="draining")
    store.set_unreachable(False)
    await wait_for(lambda: _tainted(observer), timeout=3, message="tainted once the store is back")
    await stream.read()  # the drain waited for it (longer than the 2 s cleanup budget)
    await drain
    assert runtime.cleanup_cut_short is False
    assert (await observer.get_prefix("shoal/v1/")).items == []


async def test_a_put_back_longer_than_the_lease_ttl_keeps_the_lease_it_puts_back_under(
    tmp_path: Path,
) -> None:
    """What was wrong: cards deleted behind the worker's back (`etcdctl del --prefix`, a store
    restored from a backup) were put back in the lease loop's step with no keepalive until
    it finished: 8,000 on etcd took past the 5 s TTL, the lease expired and the whole worker
    left discovery, instance and every card, before a new lease put it back. What holds now:
    the lease is kept alive beside the put-back, which ends under the lease it began under."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    observer = await open_store(url)
    runtime = Runtime(url, lease_ttl=0.6, drain_timeout=0)
    await runtime.start()
    try:
        engine = await serve_mocker(runtime, speedup=0)
        endpoint = runtime.endpoint(EP)
        adapters = 30
        for i in range(adapters):
            async with endpoint.sync_lock:
                await endpoint.attach_served(await engine.load_adapter(f"lora-{i}", "/a"))
        registrations = runtime.registrations
        lease = registrations.lease_id
        assert lease is not None
        store = registrations.store
        real = {name: getattr(store, name) for name in ("put", "create", "put_many")}

        def slowed(name: str) -> Any:
            async def slow(key_or_items: Any, *args: Any, **kwargs: Any) -> Any:
                items = 1 if isinstance(key_or_items, str) else len(key_or_items)
                await asyncio.sleep(0.05 * items)  # (31 cards: two and a half TTLs)
                return await real[name](key_or_items, *args, **kwargs)

            return slow

        prefix = ModelKey(EndpointId.parse(EP), lease).key
        for kv in (await observer.get_prefix(prefix)).items:
            await observer.delete(kv.key)
        for name in real:
            setattr(store, name, slowed(name))

        async def all_back() -> bool:
            return len((await observer.get_prefix(prefix)).items) == adapters + 1

        await wait_for(all_back, timeout=30, message="every card back under the same lease")
        assert registrations.grants == 1 and registrations.lease_id == lease
        await wait_for(lambda: registrations.lease_problem() is None, timeout=5)
    finally:
        await runtime.drain(timeout=0)
        await observer.close()


async def test_a_re_registration_longer_than_the_lease_ttl_keeps_its_new_lease_and_finishes(
    tmp_path: Path,
) -> None:
    """What was wrong: after a lost lease the re-put of every key ran in one lease-loop step
    with no keepalive of the new lease until it finished; a re-put longer than the TTL (a
    worker with thousands of adapters) lost the new lease half-way, and the next one, for
    ever. What holds now: the new lease is kept alive beside the re-put, so a re-put of
    more than two TTLs (a slow store, on real SQLite) finishes and every key is back."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    observer = await open_store(url)
    runtime = Runtime(url, lease_ttl=0.6, drain_timeout=0)
    await runtime.start()
    try:
        engine = await serve_mocker(runtime, speedup=0)
        endpoint = runtime.endpoint(EP)
        adapters = 30
        for i in range(adapters):
            async with endpoint.sync_lock:
                await endpoint.attach_served(await engine.load_adapter(f"lora-{i}", "/a"))
        registrations = runtime.registrations
        first = registrations.lease_id
        assert first is not None
        store = registrations.store
        put_many = store.put_many

        async def slow_put(items: Sequence[tuple[str, bytes]], *, lease: int = 0) -> int:
            if lease != first:  # the re-put: 30 x 0.05 s, two and a half TTLs
                await asyncio.sleep(0.05 * len(items))
            return await put_many(items, lease=lease)

        store.put_many = slow_put  # type: ignore[method-assign]
        await observer.revoke(first)

        await wait_for(
            lambda: registrations.grants > 1 and registrations.lease_problem() is None,
            timeout=30,
            message="re-registered under a new lease",
        )
        new = registrations.lease_id
        assert new is not None and new != first
        snap = await observer.get_prefix(ModelKey(EndpointId.parse(EP), new).key)
        assert len(snap.items) == adapters + 1
        assert len(await Discovery(observer).list()) == adapters + 1
    finally:
        await runtime.drain(timeout=0)
        await observer.close()


def _adapter(name: str) -> ServedModel:
    return ServedModel(name=name, source=f"test://{name}", adapter=name, base_model="a")


async def test_the_models_loop_refuses_a_bad_adapter_alone_logs_it_once_and_announces_the_rest(
    runtime: Runtime, observer: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """What was wrong: a listed adapter whose card cannot be built made every sync raise
    before the adapters listed after it (logged as a failed sync each second). What holds
    now: it is refused alone, logged once and counted while listed unchanged (not retried
    each second), and dropped from `refused` once the engine stops listing it."""
    engine = Switchable()
    endpoint = runtime.endpoint(EP)
    await endpoint.serve(engine)
    bad = "y" * 600
    engine.models = [*engine.models, _adapter(bad), _adapter("good-lora")]
    await wait_for(lambda: _names(observer, {"a", "good-lora"}), timeout=5)
    for _ in range(3):
        await endpoint.sync_models()

    assert list(endpoint.refused) == [bad] and endpoint.refusals == 1
    warnings = [r for r in caplog.records if "not announcing" in r.getMessage()]
    assert len(warnings) == 1 and bad not in warnings[0].getMessage()
    assert (
        runtime.metrics_registry.get_sample_value("shoal_worker_models_refused", {"endpoint": EP})
        == 1
    )
    engine.models = [m for m in engine.models if m.name != bad]
    await endpoint.sync_models()
    assert endpoint.refused == {}


async def test_a_model_refused_for_a_passing_reason_is_announced_once_it_is_tried_again(
    runtime: Runtime, observer: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model refused (say its metadata file could not be read for a moment) stayed
    unannounced for as long as the engine listed it unchanged: a live model forgotten. The
    refused are tried again every `REFUSED_RETRY` seconds (0 here), listed the same or not."""
    engine = Switchable()
    endpoint = runtime.endpoint(EP)
    await endpoint.serve(engine)
    await wait_for(lambda: _names(observer, {"a"}), timeout=5)
    real = endpoint.card_of
    failures = [1]

    async def flaky(model: ServedModel) -> tuple[ModelCard, str | None, dict[str, bytes]]:
        if model.name == "flaky-lora" and failures:
            failures.pop()
            raise ValueError("metadata file unreadable for a moment")
        return await real(model)

    monkeypatch.setattr(endpoint, "card_of", flaky)
    engine.models = [*engine.models, _adapter("flaky-lora")]
    await endpoint.sync_models()
    assert list(endpoint.refused) == ["flaky-lora"]
    monkeypatch.setattr(endpoint_module, "REFUSED_RETRY", 0.0)
    endpoint._retry_at = 0.0  # (the retry's time has come)
    await endpoint.sync_models()
    assert endpoint.refused == {}
    await wait_for(lambda: _names(observer, {"a", "flaky-lora"}), timeout=5)


async def test_a_sync_of_an_unchanged_list_does_nothing_and_a_long_one_yields_to_the_loop(
    runtime: Runtime,
) -> None:
    """What was wrong: every second the models loop rebuilt and compared every adapter's
    model and suffix, with no yield (3,000 adapters held the loop 55-125 ms each second).
    What holds now: the mocker lists the very same objects while nothing changes and a sync
    of an unchanged list computes no suffix; a sync that compares them all yields to the
    event loop every `SYNC_BATCH` models, attaching and detaching nothing."""
    engine = await serve_mocker(runtime, speedup=0)
    endpoint = runtime.endpoint(EP)
    adapters = 600
    for i in range(adapters):
        async with endpoint.sync_lock:
            await endpoint.attach_served(await engine.load_adapter(f"lora-{i}", "/a"))
    await endpoint.sync_models()  # the first sync after the loads compares them all
    first, second = await engine.served_models(), await engine.served_models()
    assert all(a is b for a, b in zip(first, second, strict=True))

    calls = 0
    real = endpoint_module.suffix_for

    def counting(model: ServedModel) -> str | None:
        nonlocal calls
        calls += 1
        return real(model)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(endpoint_module, "suffix_for", counting)
        for _ in range(5):
            await endpoint.sync_models()
        assert calls == 0

        attached = dict(endpoint.models)
        engine._served.clear()  # equal models, new objects: compared one by one
        turns = 0
        done = False

        async def ticker() -> None:
            nonlocal turns
            while not done:
                await asyncio.sleep(0)
                turns += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = turns
        await endpoint.sync_models()
        during = turns - before
        done = True
        await task
    assert calls == adapters + 1
    assert during >= (adapters + 1) // endpoint_module.SYNC_BATCH
    assert all(endpoint.models[s] is att for s, att in attached.items())


async def test_the_several_base_models_warning_is_bounded_and_so_is_what_it_remembers(
    runtime: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    """What was wrong: an engine listing several base models got a warning naming every one
    of them, and every distinct list was remembered for ever. What holds now: the warning
    gives a count and the first few names, and at most `WARNED_KEPT` lists are remembered."""
    engine = Switchable()
    engine.models = [ServedModel(name=f"base-{i}", source="test://b") for i in range(500)]
    endpoint = runtime.endpoint(EP)
    await endpoint.serve(engine)
    (warning,) = [r.getMessage() for r in caplog.records if "base models" in r.getMessage()]
    assert "500 base models" in warning and "and 496 more" in warning
    assert "base-499" not in warning and len(warning) < 400
    for n in range(2, 300):
        engine.models = [ServedModel(name=f"base-{i}", source="test://b") for i in range(n)]
        await endpoint.sync_models()
    assert len(endpoint._warned) <= endpoint_module.WARNED_KEPT


async def test_a_drain_whose_taints_spend_the_budget_still_revokes_and_leaves_no_key(
    tmp_path: Path,
) -> None:
    """What was wrong: a drain made one store call per model to taint and one to withdraw,
    all in the shared 2 s cleanup budget, and revoked the lease last: with many adapters
    the budget ran out first, the revoke was skipped and the worker exited with its keys in
    the store until the TTL. What holds now: part of the budget is the revoke's, and with
    many models the revoke is their withdrawal (one call): on a real SQLite store that
    takes 60 ms per write, every key is gone when the drain returns."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    observer = await open_store(url)
    runtime = Runtime(url, lease_ttl=30, drain_timeout=0)
    await runtime.start()
    try:
        engine = await serve_mocker(runtime, speedup=0)
        endpoint = runtime.endpoint(EP)
        adapters = 40
        for i in range(adapters):
            async with endpoint.sync_lock:
                await endpoint.attach_served(await engine.load_adapter(f"lora-{i}", "/a"))
        assert len((await observer.get_prefix("shoal/v1/")).items) == adapters + 2
        store = runtime.store
        assert store is not None
        put, delete = store.put, store.delete

        async def slow_put(key: str, value: bytes, *, lease: int = 0) -> int:
            await asyncio.sleep(0.06)  # a slow store: 40 taints alone outlast the budget
            return await put(key, value, lease=lease)

        async def slow_delete(key: str) -> bool:
            await asyncio.sleep(0.06)  # (as slow to withdraw)
            return await delete(key)

        store.put = slow_put  # type: ignore[method-assign]
        store.delete = slow_delete  # type: ignore[method-assign]
        await runtime.drain(timeout=0)
    finally:
        await runtime.drain(timeout=0)
    try:
        assert (await observer.get_prefix("shoal/v1/")).items == []
        assert len(runtime.metadata) == 0 and len(endpoint.models) == 0
    finally:
        await observer.close()
