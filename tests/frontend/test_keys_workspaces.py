"""A key belongs to its workspace: on a frontend serving several (`--workspace A --workspace
B`), a key of B resolves model names in B's virtual models, never in A's, on every path that
resolves one (chat, completions, embeddings, a large body, a request Redis admits, `/v1/models`
and `/v1/models/{name}`); fleet models stay reachable to every key. A request without a team's
key (the operator's `--api-key`) keeps the first `--workspace` winning a name.

Grants and routes are written into the store as the models controller writes them; in-process
frontends, fake workers, the official `openai` client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from shoal.discovery import FleetTarget, Route, publish_route
from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker, openai_client
from tests.frontend.support import FakeWorker, serving
from tests.helpers import wait_for
from tests.redis_server import RedisServer

CHAT = [{"role": "user", "content": "hi"}]
KEY_A = "sk-shoal-" + "a" * 43
KEY_B = "sk-shoal-" + "b" * 43
LISTED_B = "sk-shoal-" + "l" * 43  # of B, its allow-list naming A's virtual model
OPERATOR = "operator"
WORKSPACES = ("team-a", "team-b")
ROUTES = (  # (workspace, name, the fleet model it goes to)
    ("team-a", "a-only", "model-a"),
    ("team-a", "shared", "model-a"),
    ("team-a", "model-b", "model-a"),  # named like a fleet model (as passthroughs are)
    ("team-b", "shared", "model-b"),
    ("team-b", "b-only", "model-b"),
)


async def grant(store: Store, workspace: str, secret: str, **fields: Any) -> Grant:
    made = Grant(workspace=workspace, name="team", hash=hash_secret(secret), **fields)
    await store.put(made.key, made.to_json())
    return made


async def two_workspaces(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend, **settings: Any
) -> tuple[Frontend, dict[str, FakeWorker]]:
    """A frontend serving team-a then team-b, with `ROUTES` and a key of each."""
    workers = {name: await start_worker(name) for name in ("model-a", "model-b")}
    for workspace, name, target in ROUTES:
        await publish_route(store, Route(workspace=workspace, name=name,
                                         targets=(FleetTarget(target),)))  # fmt: skip
    await grant(store, "team-a", KEY_A)
    await grant(store, "team-b", KEY_B)
    await grant(store, "team-b", LISTED_B, models=("a-only", "shared"))
    settings.setdefault("api_keys", (OPERATOR,))
    frontend = await start_frontend(auth="keys", workspaces=WORKSPACES, **settings)
    held = frontend.routes.routes  # (each workspace's routes, as read)

    def loaded() -> bool:
        return (
            serving(frontend, "model-a")
            and serving(frontend, "model-b")
            and all(n in held.get(ws, {}) for ws, n, _ in ROUTES)
            and frontend.keys is not None
            and len(frontend.keys.by_hash) >= 3
        )

    await wait_for(loaded, message="routes, keys and workers loaded")
    return frontend, workers


async def served(frontend: Frontend, key: str, model: str) -> str:
    """The fleet model that answered a chat for `model` made with `key`."""
    async with openai_client(frontend, api_key=key) as client:
        answer = await client.chat.completions.create(model=model, messages=CHAT)  # type: ignore[arg-type]
    return answer.model


async def not_found(frontend: Frontend, key: str, model: str) -> str | None:
    """The error code of a chat for `model` made with `key` that answered 404."""
    with pytest.raises(openai.NotFoundError) as caught:
        await served(frontend, key, model)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error", body
    assert body["param"] == "model" and model in body["message"], body
    return caught.value.code


async def listed(frontend: Frontend, key: str) -> list[str]:
    async with openai_client(frontend, api_key=key) as client:
        return [m.id async for m in client.models.list()]


async def retrieved(frontend: Frontend, key: str, name: str) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{frontend.url}/v1/models/{name}", headers={"authorization": f"Bearer {key}"}
        ) as response,
    ):
        body = await response.json()
        if response.status == 200:
            assert body["id"] == name
        else:
            assert body["error"]["code"] == "model_not_found", body
        return response.status


async def test_a_key_of_one_workspace_cannot_reach_anothers_virtual_model(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """A key of team-b asking for team-a's only virtual model got team-a's route (200, from
    model-a): it is answered 404 `model_not_found`, as a model that does not exist is."""
    frontend, workers = await two_workspaces(store, start_worker, start_frontend)
    assert await not_found(frontend, KEY_B, "a-only") == "model_not_found"
    assert await not_found(frontend, KEY_B, "no-such-model") == "model_not_found"
    assert workers["model-a"].requests == 0
    assert await served(frontend, KEY_A, "a-only") == "model-a"
    assert await served(frontend, KEY_B, "b-only") == "model-b"
    assert await not_found(frontend, KEY_A, "b-only") == "model_not_found"
    # fleet models stay every key's
    assert await served(frontend, KEY_B, "model-a") == "model-a"


async def test_a_name_both_workspaces_define_is_each_keys_own_route(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """`shared` is team-a's alias of model-a and team-b's of model-b: team-b's key was sent
    to model-a (the first `--workspace` won for every request). And team-a's `model-b`, an
    alias named like the fleet model, hid the fleet model from team-b's key."""
    frontend, workers = await two_workspaces(store, start_worker, start_frontend)
    assert await served(frontend, KEY_B, "shared") == "model-b"
    assert await served(frontend, KEY_A, "shared") == "model-a"
    assert await served(frontend, KEY_B, "model-b") == "model-b"  # the fleet model
    assert await served(frontend, KEY_A, "model-b") == "model-a"  # its own route
    assert (workers["model-a"].requests, workers["model-b"].requests) == (2, 2)


async def test_requests_without_a_team_key_still_take_the_first_workspaces_route(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    frontend, _ = await two_workspaces(store, start_worker, start_frontend)
    assert await served(frontend, OPERATOR, "shared") == "model-a"
    assert await served(frontend, OPERATOR, "model-b") == "model-a"
    assert await served(frontend, OPERATOR, "a-only") == "model-a"
    assert await served(frontend, OPERATOR, "b-only") == "model-b"
    assert await listed(frontend, OPERATOR) == ["a-only", "b-only", "model-a", "model-b", "shared"]


async def test_every_proxied_route_resolves_in_the_keys_workspace(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """Completions, embeddings, a stream and a body large enough for the decoder process
    resolve as chat does."""
    from shoal.frontend.proxy.fields import LARGE_BODY

    frontend, _ = await two_workspaces(store, start_worker, start_frontend)
    async with openai_client(frontend, api_key=KEY_B) as client:
        text = await client.completions.create(model="shared", prompt="hi")
        assert text.model == "model-b"
        vectors = await client.embeddings.create(model="shared", input="hi")
        assert vectors.model == "model-b"
        chunks = await client.chat.completions.create(model="shared", messages=CHAT, stream=True)  # type: ignore[arg-type]
        assert {chunk.model async for chunk in chunks} == {"model-b"}
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="a-only", prompt="hi")
        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="a-only", input="hi")
        large = [{"role": "user", "content": "x" * LARGE_BODY}]
        answer = await client.chat.completions.create(model="shared", messages=large)  # type: ignore[arg-type]
        assert answer.model == "model-b"
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="a-only", messages=large)  # type: ignore[arg-type]


async def test_a_keys_model_listing_shows_its_own_workspace_and_the_fleet(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    frontend, _ = await two_workspaces(store, start_worker, start_frontend)
    assert await listed(frontend, KEY_A) == ["a-only", "model-a", "model-b", "shared"]
    assert await listed(frontend, KEY_B) == ["b-only", "model-a", "model-b", "shared"]
    assert await listed(frontend, KEY_B) == ["b-only", "model-a", "model-b", "shared"]  # (cached)
    assert await retrieved(frontend, KEY_B, "a-only") == 404
    assert await retrieved(frontend, KEY_B, "shared") == 200
    assert await retrieved(frontend, KEY_B, "model-b") == 200
    assert await retrieved(frontend, KEY_A, "b-only") == 404
    assert await retrieved(frontend, OPERATOR, "b-only") == 200
    # a route of team-a deleted: team-a's listing follows, team-b's is as it was
    await store.delete(Route(workspace="team-a", name="a-only", targets=()).key)
    await wait_for(lambda: "a-only" not in frontend.routes.routes["team-a"])
    assert await listed(frontend, KEY_A) == ["model-a", "model-b", "shared"]
    assert await listed(frontend, KEY_B) == ["b-only", "model-a", "model-b", "shared"]


async def test_an_allow_list_naming_another_workspaces_model_does_not_open_it(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    frontend, workers = await two_workspaces(store, start_worker, start_frontend)
    assert await not_found(frontend, LISTED_B, "a-only") == "model_not_found"
    assert workers["model-a"].requests == 0
    assert await served(frontend, LISTED_B, "shared") == "model-b"
    assert await listed(frontend, LISTED_B) == ["shared"]
    assert await retrieved(frontend, LISTED_B, "a-only") == 404
    with pytest.raises(openai.PermissionDeniedError):  # not in its allow-list: as before
        await served(frontend, LISTED_B, "b-only")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


async def test_a_request_redis_admits_resolves_in_the_keys_workspace(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    redis_server: RedisServer,
) -> None:
    """A key whose rpm Redis decides at each request waits for Redis' answer before it is
    forwarded (`gate._Waiting`): that path resolves the model in the key's workspace too,
    and its usage is the key's."""
    await grant(store, "team-b", "sk-shoal-" + "r" * 43, rpm=10)
    frontend, _ = await two_workspaces(
        store, start_worker, start_frontend, limits_url=redis_server.url
    )
    await wait_for(lambda: frontend.keys is not None and len(frontend.keys.by_hash) == 4)
    await wait_for(lambda: frontend.limits.shared)
    limited = "sk-shoal-" + "r" * 43
    assert await served(frontend, limited, "shared") == "model-b"
    assert await not_found(frontend, limited, "a-only") == "model_not_found"


def test_one_lookup_resolves_a_name_in_a_keys_workspace_or_in_the_first_defining_it() -> None:
    """The lookup every path shares: `RouteTable.lookup(name, workspace)`; None: the first
    `--workspace` that defines the name."""
    from shoal.frontend.registry.registry import Registry
    from shoal.frontend.virtual.virtual import RouteTable

    table = RouteTable(Registry(), WORKSPACES)
    for workspace, name, target in ROUTES:
        made = Route(workspace=workspace, name=name, targets=(FleetTarget(target),))
        table.put(made.key, made.to_json())
    shared = {ws: table.lookup("shared", ws) for ws in (*WORKSPACES, None)}
    assert {ws: vm.workspace for ws, vm in shared.items() if vm is not None} == {
        "team-a": "team-a", "team-b": "team-b", None: "team-a"
    }  # fmt: skip
    assert table.lookup("a-only", "team-b") is None and table.lookup("b-only", "team-a") is None
    assert table.lookup("b-only", None) is table.lookup("b-only", "team-b")
    assert table.lookup("a-only", "elsewhere") is None
    deleted = Route(workspace="team-a", name="shared", targets=())
    table.delete(deleted.key)
    assert table.lookup("shared", None) is table.lookup("shared", "team-b")
    assert table.lookup("shared", "team-a") is None
    assert table.describe()["models_total"] == 4
    table.close()


async def test_each_workspaces_listing_is_made_in_slices_once_and_kept_until_it_changes(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """Keys of three workspaces of many virtual models each: each workspace's listing is made
    `LISTING_SLICE` models a turn of the loop, once for its callers, the discovered models'
    objects once for all three; it is kept until its own workspace's routes change."""
    from shoal.frontend import listings
    from tests.helpers import LoopTurns

    await start_worker("mock-llm")
    workspaces = ("w0", "w1", "w2")
    count = 2 * listings.LISTING_SLICE
    for ws in workspaces:
        await grant(store, ws, f"sk-shoal-{ws}" + "k" * 41)
        made = [Route(workspace=ws, name=f"{ws}-vm{i:05d}", targets=(FleetTarget("mock-llm"),))
                for i in range(count)]  # fmt: skip
        await store.put_many([(r.key, r.to_json()) for r in made])
    frontend = await start_frontend(auth="keys", workspaces=workspaces)
    routes = frontend.routes

    def loaded() -> bool:
        return (
            serving(frontend)
            and all(len(routes.routes[ws]) == count for ws in workspaces)
            and frontend.keys is not None
            and len(frontend.keys.by_hash) == 3
        )

    await wait_for(loaded)

    async def listings_of_every_key() -> dict[str, list[str]]:
        async def one(ws: str) -> list[str]:
            return await listed(frontend, f"sk-shoal-{ws}" + "k" * 41)

        return dict(zip(workspaces, await asyncio.gather(*map(one, workspaces)), strict=True))

    versions = [frontend.registry.version, *(routes.version_of(ws) for ws in workspaces)]
    turns = LoopTurns().wrap(listings.Listings, "virtual_object")
    fleet = LoopTurns().wrap(listings.Listings, "model_object")
    try:
        first = await listings_of_every_key()
        again = await listings_of_every_key()
    finally:
        await turns.stop()
        await fleet.stop()
    for ws in workspaces:
        assert len(first[ws]) == count + 1 and first[ws][0] == "mock-llm"
        assert all(name.startswith(f"{ws}-") for name in first[ws][1:])
    assert again == first
    assert turns.most_per_turn <= listings.LISTING_SLICE, turns.most_per_turn
    if [frontend.registry.version, *(routes.version_of(ws) for ws in workspaces)] == versions:
        assert sum(turns.per_turn.values()) == 3 * count  # (each made once, for two callers)
        assert sum(fleet.per_turn.values()) == 1  # (the fleet's objects: once for all three)

    added = Route(workspace="w1", name="w1-added", targets=(FleetTarget("mock-llm"),))
    await store.put(added.key, added.to_json())
    await wait_for(lambda: "w1-added" in routes.routes["w1"])
    turns = LoopTurns().wrap(listings.Listings, "virtual_object")
    try:
        after = await listings_of_every_key()
    finally:
        await turns.stop()
    assert "w1-added" in after["w1"] and after["w0"] == first["w0"] and after["w2"] == first["w2"]
    if frontend.registry.version == versions[0]:
        assert sum(turns.per_turn.values()) == count + 1  # (w1's alone made again)


async def test_a_listing_of_several_workspaces_is_sorted_and_encoded_a_slice_per_turn(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """The view without a team's key holds every workspace's virtual models: three of 10,000
    each were sorted (17-50 ms) and encoded (15-24 ms) in one turn of the loop. Now each slice
    is sorted as it is made, and the slices merged and encoded `LISTING_SLICE` a turn."""
    from shoal.frontend import listings
    from tests.helpers import LoopTurns

    await start_worker("mock-llm")
    workspaces = ("w0", "w1", "w2")
    count = 2 * listings.LISTING_SLICE
    for ws in workspaces:  # (names interleaved across workspaces: the merge has work to do)
        made = [Route(workspace=ws, name=f"vm{i:05d}-{ws}", targets=(FleetTarget("mock-llm"),))
                for i in reversed(range(count))]  # fmt: skip
        await store.put_many([(r.key, r.to_json()) for r in made])
    frontend = await start_frontend(workspaces=workspaces)
    await wait_for(lambda: serving(frontend) and len(frontend.routes.models) == 3 * count)
    encoded = LoopTurns().wrap(listings, "_json", units=len)
    try:
        async with openai_client(frontend) as client:
            names = [m.id async for m in client.models.list()]
    finally:
        await encoded.stop()
    assert len(names) == 3 * count + 1 and names == sorted(names)
    assert sum(encoded.per_turn.values()) == 3 * count + 1  # (every object encoded once)
    assert encoded.most_per_turn <= listings.LISTING_SLICE, encoded.most_per_turn


async def test_health_asked_with_a_team_key_describes_no_routes(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """`/health` built its whole body, every workspace's routes described (8 ms a call at 10
    workspaces of 10,000 virtual models), then kept the status alone for a caller without the
    operator's key: anyone could make the frontend do that work per request. It is told the
    status without the details being made; the operator still gets them."""
    frontend, _ = await two_workspaces(store, start_worker, start_frontend)
    from tests.helpers import LoopTurns

    described = LoopTurns().wrap(frontend.routes, "describe")
    try:
        async with aiohttp.ClientSession() as session:
            for key in (KEY_B, KEY_A, None):
                headers = {"authorization": f"Bearer {key}"} if key else {}
                async with session.get(f"{frontend.url}/health", headers=headers) as answer:
                    assert await answer.json() == {"status": "ok"}
            assert described.on_loop == 0
            headers = {"authorization": f"Bearer {OPERATOR}"}
            async with session.get(f"{frontend.url}/health", headers=headers) as answer:
                body = await answer.json()
    finally:
        await described.stop()
    assert body["virtual_models"]["models_total"] == len(ROUTES)
    assert described.on_loop == 1
