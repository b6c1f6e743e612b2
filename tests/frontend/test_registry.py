"""Models, worker sets and checksums, as served by `/v1/models` and used by routing."""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

import aiohttp
import msgspec
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from shoal.cards import ModelCard, ModelType
from shoal.discovery import Discovery, EndpointId, InstanceInfo, ModelInstance, ModelKey
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.registry.registrations import State
from shoal.frontend.registry.registry import Registry
from shoal.frontend.registry.versions import Versions
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker, openai_client
from tests.frontend.support import serving
from tests.helpers import wait_for

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def refused(frontend: Frontend, model: str) -> float:
    value = frontend.metrics.registry.get_sample_value(
        "shoal_frontend_cards_refused_total", {"model": model}
    )
    return value or 0.0


async def test_card_with_another_checksum_in_the_same_set_is_refused(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    old = await start_worker(version="1")
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend))
    new = await start_worker(version="2")  # same namespace/component/role, other files
    await wait_for(lambda: refused(frontend, "mock-llm") == 1)
    model = frontend.registry.models["mock-llm"]
    assert [ws.mdcsum for ws in model.sets.values()] == [old.card().mdcsum]
    assert model.live_instances == 1
    assert new.key not in frontend.registry
    # Once the old set is gone, the refused card forms the new one.
    await old.unregister()
    await wait_for(lambda: new.key in frontend.registry)
    assert [ws.mdcsum for ws in frontend.registry.models["mock-llm"].sets.values()] == [
        new.card().mdcsum
    ]


async def test_rolling_upgrade_in_another_namespace_splits_requests_by_live_instances(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    old = [await start_worker(namespace="blue", version="1") for _ in range(3)]
    new = [await start_worker(namespace="green", version="2")]
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, instances=4))
    assert len(frontend.registry.models["mock-llm"].sets) == 2
    picks = collections.Counter(
        frontend.registry.models["mock-llm"].pick_set().id.namespace  # type: ignore[union-attr]
        for _ in range(4000)
    )
    assert 0.68 < picks["blue"] / 4000 < 0.82  # 3 of 4 live instances
    client = openai_client(frontend)
    for _ in range(8):
        await client.chat.completions.create(model="mock-llm", messages=CHAT)
    assert sum(w.requests for w in old) + new[0].requests == 8


async def test_frontend_serves_only_its_namespaces(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mine", namespace="team-a")
    await start_worker("theirs", namespace="team-b")
    frontend = await start_frontend(namespaces=("team-a",))
    await wait_for(lambda: serving(frontend, "mine"))
    await frontend.watcher.reconcile()  # type: ignore[union-attr]
    assert sorted(frontend.registry.models) == ["mine"]


async def test_models_endpoints_list_serving_models_in_openai_format(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("org/Model-A")
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, "org/Model-A"))
    client = openai_client(frontend)
    listed = await client.models.list()
    assert [m.id for m in listed.data] == ["org/Model-A"]
    assert listed.data[0].object == "model"
    assert listed.data[0].owned_by == "shoal"
    one = await client.models.retrieve("org/Model-A")
    assert one.id == "org/Model-A"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")


async def test_a_model_whose_instances_all_drain_is_listed_and_answers_503_with_retry_after(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """One story everywhere: the model still exists, it is unavailable for a moment."""
    draining = await start_worker("model-b")
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, "model-b"))
    await draining.taint("draining")
    await wait_for(lambda: not serving(frontend, "model-b"))
    client = openai_client(frontend)
    assert [m.id for m in (await client.models.list()).data] == ["model-b"]
    with pytest.raises(openai.APIStatusError) as retrieved:
        await client.models.retrieve("model-b")
    assert retrieved.value.status_code == 503
    assert int(retrieved.value.response.headers["retry-after"]) > 0
    assert "no ready instance" in retrieved.value.message
    with pytest.raises(openai.APIStatusError) as requested:
        await client.chat.completions.create(model="model-b", messages=CHAT)
    assert requested.value.status_code == 503
    assert int(requested.value.response.headers["retry-after"]) > 0  # the same story
    assert draining.requests == 0


async def test_lora_adapter_is_served_under_its_own_name(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    base = await start_worker("base-llm")
    adapter = await start_worker("base-llm-sql", lora_of="base-llm")
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, "base-llm") and serving(frontend, "base-llm-sql"))
    async with aiohttp.ClientSession() as session:
        body = await (await session.get(f"{frontend.url}/v1/models")).json()
    by_id = {m["id"]: m for m in body["data"]}
    assert by_id["base-llm-sql"]["parent"] == "base-llm"
    assert "parent" not in by_id["base-llm"]
    reply = await openai_client(frontend).chat.completions.create(
        model="base-llm-sql",
        messages=CHAT,
    )
    assert reply.model == "base-llm-sql"
    assert adapter.requests == 1 and base.requests == 0


async def test_v1_models_reflects_join_leave_and_taints_right_after_each(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=60)
    async with aiohttp.ClientSession() as session:

        async def listed() -> list[str]:
            body = await (await session.get(f"{frontend.url}/v1/models")).json()
            return [m["id"] for m in body["data"]]

        # Each change is checked as soon as the registry has it, the body having been
        # encoded (and cached) before it: the change must invalidate the cached body.
        assert await listed() == []
        alpha = await start_worker("alpha")
        await wait_for(lambda: serving(frontend, "alpha"))
        assert await listed() == ["alpha"]  # join
        beta = await start_worker("beta")
        await wait_for(lambda: serving(frontend, "beta"))
        assert await listed() == ["alpha", "beta"]  # join
        await beta.taint("draining")
        await wait_for(lambda: not serving(frontend, "beta"))
        assert await listed() == ["alpha", "beta"]  # its only instance drains: still listed
        await beta.unregister()
        await wait_for(lambda: "beta" not in frontend.registry.models)
        assert await listed() == ["alpha"]  # gone: no longer listed
        await alpha.unregister()
        await wait_for(lambda: "alpha" not in frontend.registry.models)
        assert await listed() == []  # leave


def set_checksums(frontend: Frontend, model: str = "mock-llm") -> list[str]:
    entry = frontend.registry.models.get(model)
    return [] if entry is None else [ws.mdcsum for ws in entry.sets.values()]


@pytest.mark.parametrize("backend", ["memory", "etcd"])
async def test_two_frontends_with_different_histories_elect_the_same_checksum(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend, tmp_path: Path
) -> None:
    old = await start_worker(version="1")
    first = await start_frontend()
    await wait_for(lambda: serving(first))
    new = await start_worker(version="2")
    await wait_for(lambda: refused(first, "mock-llm") == 1)
    # The second frontend starts now, and the old version's metadata is slow to download:
    # the new version's card is verified first, yet the old version is the one elected.
    old.metadata_hang.clear()
    second = Frontend(
        FrontendConfig(port=0, cache_dir=tmp_path / "second"), discovery=Discovery(store)
    )
    await second.start()
    try:
        watcher = second.watcher
        assert watcher is not None
        await wait_for(lambda: watcher.registrations[new.key].state is State.REFUSED)
        assert new.key not in second.registry
        old.metadata_hang.set()
        await wait_for(lambda: serving(second))
        assert set_checksums(second) == set_checksums(first) == [old.card().mdcsum]
        answer = await openai_client(second).chat.completions.create(
            model="mock-llm", messages=CHAT
        )
        assert answer.choices[0].message.content == f"hello from {old.instance_id:x}"
    finally:
        await second.stop()


@pytest.mark.parametrize("backend", ["memory", "etcd"])
async def test_waiting_checksum_takes_over_when_every_instance_of_the_set_drains(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    old = await start_worker(version="1")
    frontend = await start_frontend(reconcile_interval=3600)
    await wait_for(lambda: serving(frontend))
    new = await start_worker(version="2")
    await wait_for(lambda: refused(frontend, "mock-llm") == 1)
    await old.taint("draining")  # rolling upgrade: the old worker drains, still registered
    await wait_for(lambda: set_checksums(frontend) == [new.card().mdcsum])
    await wait_for(lambda: serving(frontend))
    answer = await openai_client(frontend).chat.completions.create(model="mock-llm", messages=CHAT)
    assert answer.choices[0].message.content == f"hello from {new.instance_id:x}"
    watcher = frontend.watcher
    assert watcher is not None
    assert watcher.registrations[old.key].state is State.REFUSED


def test_election_depends_on_the_cards_not_on_the_order_they_arrived() -> None:
    cards = [  # (key, checksum, revision, tainted)
        ("a", "v1", 10, False),
        ("b", "v2", 20, False),
        ("c", "v1", 30, False),
        ("d", "v3", 5, True),
    ]
    winners = set()
    for order in itertools.permutations(cards):
        versions: Versions[str, str] = Versions()
        for key, checksum, revision, tainted in order:
            versions.put("set", checksum, key, revision, tainted)
        winners.add(versions.elected("set"))
    assert winners == {"v1"}  # v3 is older, but only tainted: v1's oldest untainted card wins
    versions.put("set", "v1", "a", 40, True)  # a drains: v1's oldest untainted is c (30) > b
    assert versions.elected("set") == "v2"
    versions.drop("set", "v2", "b")
    assert versions.elected("set") == "v1"  # c is v1's only untainted card left
    versions.put("set", "v1", "c", 50, True)
    assert versions.elected("set") == "v3"  # all tainted: the oldest card overall


async def test_an_adapter_names_its_parent_only_while_the_base_model_is_listed(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend()
    await start_worker("base-llm-sql", lora_of="base-llm")
    await wait_for(lambda: serving(frontend, "base-llm-sql"))

    async def listed() -> dict[str, dict[str, object]]:
        async with aiohttp.ClientSession() as session:
            body = await (await session.get(f"{frontend.url}/v1/models")).json()
        return {m["id"]: m for m in body["data"]}

    assert "parent" not in (await listed())["base-llm-sql"]  # no model `base-llm` to name
    one = await openai_client(frontend).models.retrieve("base-llm-sql")
    assert getattr(one, "parent", None) is None
    base = await start_worker("base-llm")
    await wait_for(lambda: serving(frontend, "base-llm"))
    assert (await listed())["base-llm-sql"]["parent"] == "base-llm"
    await base.unregister()
    await wait_for(lambda: "base-llm" not in frontend.registry.models)
    assert "parent" not in (await listed())["base-llm-sql"]


async def test_created_is_the_same_on_every_frontend_and_across_restarts(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend, tmp_path: Path
) -> None:
    for created in (1_700_000_500, 1_700_000_000):  # when each worker registered the model
        worker = await start_worker()
        assert worker.lease is not None
        card = msgspec.structs.replace(worker.card(), created=created)
        await store.put(worker.key.key, card.to_json(), lease=worker.lease.id)
    first = await start_frontend()
    await wait_for(lambda: serving(first, instances=2))

    async def created_on(frontend: Frontend) -> int:
        model = await openai_client(frontend).models.retrieve("mock-llm")
        listed = (await openai_client(frontend).models.list()).data
        assert [m.created for m in listed] == [model.created]
        return model.created

    assert await created_on(first) == 1_700_000_000  # the earliest registration
    for name in ("second", "third"):  # another frontend, then one started after it stopped
        other = Frontend(
            FrontendConfig(port=0, cache_dir=tmp_path / name), discovery=Discovery(store)
        )
        await other.start()
        try:
            await wait_for(lambda: serving(other, instances=2))  # noqa: B023
            assert await created_on(other) == 1_700_000_000
        finally:
            await other.stop()


def instance(instance_id: int, *types: str, taints: tuple[str, ...] = ()) -> ModelInstance:
    endpoint = EndpointId("default", "backend", "generate")
    card = ModelCard.build(
        display_name="m",
        slug="m",
        source="test/m",
        model_types=list(types),
        context_length=4096,
        runtime_config={"taints": list(taints)},
    )
    url = f"http://127.0.0.1:{9000 + instance_id}"
    info = InstanceInfo("default", "backend", "generate", instance_id, f"{url}/v1", url)
    return ModelInstance(ModelKey(endpoint, instance_id), card, info)


def test_each_request_kind_goes_only_to_instances_whose_card_declares_it() -> None:
    registry = Registry()
    try:
        for i in (1, 2, 3):
            registry.join(instance(i, "chat", "completions"))
        registry.join(instance(4, "embeddings"))  # same checksum: one worker set
        model = registry.models["m"]
        assert len(model.sets) == 1 and model.live_instances == 4
        embeddings, chat = model.for_kind(ModelType.EMBEDDINGS), model.for_kind(ModelType.CHAT)
        assert embeddings is not None and chat is not None
        for _ in range(20):
            ws = embeddings.pick_set()
            assert ws is not None and [u.instance_id for u in ws.routable] == [4]
            ws = chat.pick_set()
            assert ws is not None and [u.instance_id for u in ws.routable] == [1, 2, 3]
        # The embeddings instance drains: no instance left for embeddings; chat unaffected.
        registry.set_taints(instance(4, "embeddings").key, ("draining",))
        embeddings = model.for_kind(ModelType.EMBEDDINGS)
        assert embeddings is not None and not embeddings.serving
        assert embeddings.pick_set() is None
        assert model.for_kind(ModelType.CHAT) is not None and model.serving
    finally:
        registry.close()


def test_a_model_whose_cards_all_declare_the_same_kinds_is_its_own_view() -> None:
    registry = Registry()
    try:
        registry.join(instance(1, "chat", "embeddings"))
        registry.join(instance(2, "chat", "embeddings"))
        model = registry.models["m"]
        assert model.for_kind(ModelType.CHAT) is model  # nothing allocated per kind
        assert model.for_kind(ModelType.EMBEDDINGS) is model
        assert model.for_kind(ModelType.COMPLETIONS) is None
    finally:
        registry.close()


async def test_embeddings_requests_reach_only_the_instances_that_declare_embeddings(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend()
    chat_only = [await start_worker(model_types=("chat",)) for _ in range(2)]
    embedder = await start_worker(model_types=("chat", "embeddings"))
    await wait_for(lambda: serving(frontend, instances=3))
    async with aiohttp.ClientSession() as session:
        for _ in range(6):
            response = await session.post(
                f"{frontend.url}/v1/embeddings", json={"model": "mock-llm", "input": "hello"}
            )
            assert response.status == 200
        await embedder.taint("draining")
        await wait_for(lambda: serving(frontend, instances=2))
        response = await session.post(
            f"{frontend.url}/v1/embeddings", json={"model": "mock-llm", "input": "hello"}
        )
        assert response.status == 503  # chat instances remain; none of them embeds
    assert embedder.requests == 6
    assert [w.requests for w in chat_only] == [0, 0]
