"""`--auth keys`: grants written into the store (as the models controller writes them),
checked by in-process frontends with the official `openai` client."""

from __future__ import annotations

import json
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from shoal.discovery.grants import Grant, grant_key, hash_secret
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker, openai_client
from tests.helpers import wait_for

CHAT = [{"role": "user", "content": "hi"}]
SECRET = "sk-shoal-" + "a" * 43
OTHER = "sk-shoal-" + "b" * 43


async def grant(store: Store, secret: str, pepper: str = "", **fields: object) -> Grant:
    made = Grant(workspace="default", name="team", hash=hash_secret(secret, pepper), **fields)  # type: ignore[arg-type]
    await store.put(made.key, made.to_json())
    return made


async def chat(frontend: Frontend, key: str, model: str = "mock-llm") -> str:
    async with openai_client(frontend, api_key=key) as client:
        answer = await client.chat.completions.create(model=model, messages=CHAT)  # type: ignore[arg-type]
    return answer.choices[0].message.content or ""


async def refused(frontend: Frontend, key: str, model: str = "mock-llm") -> int | None:
    try:
        await chat(frontend, key, model)
    except openai.APIStatusError as exc:
        return exc.status_code
    return None


async def test_a_key_reaches_only_the_models_of_its_allow_list(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    await start_worker("other")
    await grant(store, SECRET, models=("mock-llm",))
    await grant(store, OTHER)  # no allow-list: every model
    frontend = await start_frontend(auth="keys", api_keys=("operator",))
    await wait_for(lambda: len(frontend.registry.models) == 2)
    assert await chat(frontend, SECRET)
    assert await chat(frontend, OTHER, "other") and await chat(frontend, "operator", "other")
    with pytest.raises(openai.PermissionDeniedError) as caught:
        await chat(frontend, SECRET, "other")
    assert caught.value.code == "model_not_allowed"
    # a model that does not exist answers the same 403: the key learns nothing about it
    with pytest.raises(openai.PermissionDeniedError):
        await chat(frontend, SECRET, "no-such-model")
    for wrong in ("sk-shoal-unknown", "x", SECRET + "x"):
        with pytest.raises(openai.AuthenticationError):
            await chat(frontend, wrong)
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{frontend.url}/v1/chat/completions", json={"model": "mock-llm"}) as resp,
    ):
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    async with openai_client(frontend, api_key=SECRET) as client:
        assert [m.id async for m in client.models.list()] == ["mock-llm"]
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("other")
    async with openai_client(frontend, api_key=OTHER) as client:
        assert sorted([m.id async for m in client.models.list()]) == ["mock-llm", "other"]


async def test_disabled_and_expired_keys_are_refused_with_401(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    await grant(store, SECRET, disabled=True)
    await grant(store, OTHER, expires_at=time.time() + 3)
    frontend = await start_frontend(auth="keys")
    await wait_for(lambda: "mock-llm" in frontend.registry.models)
    with pytest.raises(openai.AuthenticationError) as caught:
        await chat(frontend, SECRET)
    assert caught.value.code == "key_disabled"
    assert await chat(frontend, OTHER)
    ends = frontend.keys.by_hash[hash_secret(OTHER)].expires_at  # type: ignore[union-attr]
    await wait_for(lambda: time.time() > ends, timeout=5)  # type: ignore[operator]
    with pytest.raises(openai.AuthenticationError) as caught:
        await chat(frontend, OTHER)
    assert caught.value.code == "key_expired"


async def test_a_revoked_key_is_refused_on_two_frontends_within_a_second(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    made = await grant(store, SECRET)
    fronts = [await start_frontend(auth="keys") for _ in range(2)]
    await wait_for(lambda: all("mock-llm" in f.registry.models for f in fronts))
    for frontend in fronts:
        assert await chat(frontend, SECRET)
    await store.delete(made.key)
    revoked = time.monotonic()
    for frontend in fronts:
        await wait_for(lambda f=frontend: hash_secret(SECRET) not in f.keys.by_hash, timeout=1.0)  # type: ignore[misc,union-attr]
        assert await refused(frontend, SECRET) == 401
    assert time.monotonic() - revoked < 1.0


async def test_the_pepper_is_part_of_the_hash(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    await grant(store, SECRET, pepper="pepper-1")
    await grant(store, OTHER)  # hashed without the pepper: not this frontend's key
    frontend = await start_frontend(auth="keys", key_pepper="pepper-1")
    await wait_for(lambda: "mock-llm" in frontend.registry.models)
    assert await chat(frontend, SECRET)
    assert await refused(frontend, OTHER) == 401


async def test_a_malformed_grant_is_reported_and_never_hides_a_valid_one(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    made = await grant(store, SECRET)
    await store.put(grant_key("default", "f" * 64), b'{"not": "a grant"}')
    frontend = await start_frontend(auth="keys", api_keys=("operator",))  # /health details
    await wait_for(lambda: "mock-llm" in frontend.registry.models)
    await store.put(made.key, b"garbage")  # the valid grant held at this key stays
    copied = Grant(workspace="default", name="x", hash="e" * 64).to_json()
    await store.put(grant_key("default", "d" * 64), copied)  # a value under another's key
    await wait_for(lambda: len(frontend.keys.skipped) == 3)  # type: ignore[union-attr]
    assert await chat(frontend, SECRET)
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{frontend.url}/health", headers={"authorization": "Bearer operator"}
        ) as response,
    ):
        text = await response.text()
    assert '"keys":{"keys":1' in text.replace(" ", "") and SECRET not in text
    assert hash_secret(SECRET) not in text


async def test_the_secret_never_appears_in_health_metrics_or_logs(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG")
    await start_worker("mock-llm")
    await grant(store, SECRET, models=("mock-llm",))
    frontend = await start_frontend(auth="keys")
    await wait_for(lambda: "mock-llm" in frontend.registry.models)
    assert await chat(frontend, SECRET)
    assert await refused(frontend, SECRET, "other") == 403
    assert await refused(frontend, SECRET + "x") == 401
    async with aiohttp.ClientSession() as session:
        for path in ("/health", "/metrics", "/v1/models"):
            async with session.get(
                f"{frontend.url}{path}", headers={"authorization": f"Bearer {SECRET}"}
            ) as response:
                assert SECRET not in await response.text()
    assert all(SECRET not in record.getMessage() for record in caplog.records)
    assert all(SECRET.encode() not in kv.value for kv in (await store.get_prefix("shoal/")).items)


async def test_a_team_key_opens_neither_the_fleet_page_nor_health_details(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    await grant(store, SECRET)
    closed = await start_frontend(auth="keys")  # no --api-key: no operator at all
    operated = await start_frontend(auth="keys", api_keys=("operator",))
    await wait_for(lambda: "mock-llm" in closed.registry.models)
    assert await chat(closed, SECRET)
    async with aiohttp.ClientSession() as session:
        for key in (None, SECRET):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            async with session.get(f"{closed.url}/ui/api/snapshot", headers=headers) as page:
                assert page.status == 401
            async with session.post(f"{closed.url}/ui/api/login", json={"key": key or ""}) as r:
                assert r.status == 401
            async with session.get(f"{closed.url}/health", headers=headers) as health:
                assert set(await health.json()) <= {"status", "reasons"}
        operator = {"authorization": "Bearer operator"}
        async with session.get(f"{operated.url}/ui/api/snapshot", headers=operator) as page:
            assert page.status == 200
        async with session.get(f"{operated.url}/health", headers=operator) as health:
            assert "models" in await health.json()


def test_health_counts_every_refused_grant_and_lists_only_the_first() -> None:
    """10,000 malformed grants in the store made `/health` list 10,000 entries, on every
    probe: the report counts them all and names the first `keys.MAX_LISTED`."""
    from shoal.bounds import MAX_LISTED
    from shoal.frontend.keys.keys import KeyRing

    ring = KeyRing(["default"])
    for n in range(10_000):
        ring.put(grant_key("default", f"{n:04x}" + "0" * 60), b"garbage")
    described = ring.describe()
    assert described["keys"] == 0 and described["skipped_total"] == 10_000
    listed = described["skipped"]
    assert isinstance(listed, list) and len(listed) == MAX_LISTED
    assert listed[0]["key"] == grant_key("default", "0" * 64)


async def test_a_team_key_reads_no_membership_view_an_operator_does(
    store: Store, tmp_path: Path
) -> None:
    """`/v1/membership` names every model, namespace and instance in the frontend's scope:
    it is an operator's route (`--api-key`), like the fleet page; a team's key, even one that
    may use a model there, is refused as if it were no key."""
    from shoal.cli.scope import membership_for
    from shoal.discovery import Discovery
    from shoal.frontend import FrontendConfig
    from tests.frontend.support import FakeWorker, serving

    workers = [await FakeWorker(m, namespace="team-a").start() for m in ("mock-llm", "secret")]
    for worker in workers:
        await worker.register(store)
    await grant(store, SECRET, models=("mock-llm",))
    sources = tmp_path / "sources.json"
    sources.write_text(json.dumps({"version": 1, "sources": [{"namespace": "team-a"}]}))
    config = FrontendConfig(port=0, cache_dir=tmp_path / "cache", namespace_sources=sources,
                            auth="keys", api_keys=("operator",))  # fmt: skip
    front = Frontend(config, discovery=Discovery(store), membership=membership_for(config))
    await front.start()
    try:
        await wait_for(lambda: serving(front, "secret") and front.keys and front.keys.by_hash)
        async with aiohttp.ClientSession() as session:
            for path in ("/v1/membership", "/v1/membership/status"):
                for key, status in ((SECRET, 401), (None, 401), ("operator", 200)):
                    headers = {"authorization": f"Bearer {key}"} if key else {}
                    async with session.get(front.url + path, headers=headers) as response:
                        text = await response.text()
                        assert response.status == status, (path, key, text)
                        assert ("secret" in text) == (path == "/v1/membership" and status == 200)
            team = {"authorization": f"Bearer {SECRET}"}
            async with session.get(f"{front.url}/v1/models", headers=team) as response:
                assert "secret" not in await response.text()  # the key's own view: its models
    finally:
        await front.stop()
        for worker in workers:
            await worker.stop()


def test_a_keys_model_listing_is_looked_up_by_its_allow_list_never_decoded() -> None:
    """A keyed `/v1/models` takes the objects of its allow-list's names from the listing of
    the registry's version (at most 1,000 look-ups), in the listing's order: the whole body
    (30,000 models: 20-45 ms to decode) is never read again."""
    from shoal.frontend.keys.keys import ModelListing, models_for

    data = [{"id": f"m-{i:05d}", "object": "model", "created": i, "owned_by": "shoal"}
            for i in range(3000)]  # fmt: skip
    listing = ModelListing(data)
    assert json.loads(listing.body) == {"object": "list", "data": data}
    assert models_for(listing, None) is listing.body  # the operator's: as it is
    listing.body = b"never decoded"  # a keyed listing does not read it
    key = Grant(workspace="w", name="k", hash="a" * 64,
                models=("m-02000", "absent", "m-00007", "m-02000"))  # fmt: skip
    assert json.loads(models_for(listing, key)) == {"object": "list", "data": [data[7], data[2000]]}


async def test_a_keys_model_listing_follows_the_registry(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    await grant(store, SECRET, models=("mock-llm", "later", "aaa"))
    frontend = await start_frontend(auth="keys")
    await wait_for(lambda: "mock-llm" in frontend.registry.models and frontend.keys.by_hash)
    async with openai_client(frontend, api_key=SECRET) as client:
        assert [m.id async for m in client.models.list()] == ["mock-llm"]
        await start_worker("later")
        await start_worker("aaa")
        await start_worker("not-allowed")
        await wait_for(lambda: len(frontend.registry.models) == 4)
        assert [m.id async for m in client.models.list()] == ["aaa", "later", "mock-llm"]
