"""A frontend that serves while its first discovery listing loads answers a model it does
not hold yet with 503 and `Retry-After` (a retry finds it), not 404: a frontend restarted on
its port under load answered 404 for live models until it had loaded them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from shoal.discovery import FleetTarget, Route
from shoal.discovery.grants import Grant, grant_key, hash_secret
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.keys.keys import KeyWatcher
from shoal.frontend.registry.watcher import ModelWatcher
from shoal.store import open_store
from tests.helpers import wait_for

SECRET = "sk-shoal-" + "a" * 43


async def test_a_model_asked_for_while_discovery_loads_is_503_retry_then_404_once_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    async def endless_load(self: ModelWatcher) -> None:  # the store answered; loading goes on
        self.store_answered.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(ModelWatcher, "start", endless_load)
    frontend = Frontend(
        FrontendConfig(store_url="memory://loading-answers", port=0, cache_dir=tmp_path)
    )
    starting = asyncio.create_task(frontend.start())  # (it serves while it loads)
    await wait_for(lambda: frontend.server is not None and frontend.server.port > 0)
    body = {"model": "not-yet", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as http:
            url = f"{frontend.url}/v1/chat/completions"
            async with http.post(url, json=body) as resp:
                answer = await resp.json()
                assert resp.status == 503, answer
                assert resp.headers.get("Retry-After") == "1"
                assert answer["error"]["code"] == "discovery_loading", answer
            assert frontend.watcher is not None
            frontend.watcher.snapshot_loaded.set()  # (the fleet is loaded: it holds no such model)
            async with http.post(url, json=body) as resp:
                answer = await resp.json()
                assert resp.status == 404, answer
                assert answer["error"]["code"] == "model_not_found", answer
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await frontend.stop()


async def test_a_model_looked_up_while_discovery_loads_is_503_retry_then_404_once_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`GET /v1/models/{model}` (the clients' `models.retrieve`) answers as a request does:
    a model not held yet while the fleet loads is 503 `discovery_loading`, not a 404 that
    tells a client the live model does not exist."""

    async def endless_load(self: ModelWatcher) -> None:
        self.store_answered.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(ModelWatcher, "start", endless_load)
    url = f"memory://loading-lookup-{tmp_path.name}"
    store = await open_store(url)  # (an alias of a fleet model, published before the start)
    alias = Route(workspace="default", name="alias", targets=[FleetTarget("not-yet")])
    await store.put(alias.key, alias.to_json())
    frontend = Frontend(FrontendConfig(store_url=url, port=0, cache_dir=tmp_path))
    starting = asyncio.create_task(frontend.start())
    await wait_for(lambda: frontend.server is not None and frontend.server.port > 0)
    try:
        async with aiohttp.ClientSession() as http:
            for name in ("not-yet", "alias"):
                async with http.get(f"{frontend.url}/v1/models/{name}") as resp:
                    answer = await resp.json()
                    assert resp.status == 503, (name, answer)
                    assert resp.headers.get("Retry-After") == "1"
                    assert answer["error"]["code"] == "discovery_loading", answer
            assert frontend.watcher is not None
            frontend.watcher.snapshot_loaded.set()
            for name in ("not-yet", "alias"):
                async with http.get(f"{frontend.url}/v1/models/{name}") as resp:
                    answer = await resp.json()
                    assert resp.status == 404, (name, answer)
                    assert answer["error"]["code"] == "model_not_found", answer
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await frontend.stop()
        await store.close()


async def test_a_valid_key_is_503_retry_while_the_keys_load_never_401(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With `--auth keys` the frontend serves before it has read its keys from the store (a
    frontend restarted on its port, its store slow to answer): a valid key is then 503
    `keys_loading` with `Retry-After` (a retry is served), never the 401 `invalid_api_key`
    that the official clients raise as `AuthenticationError` and do not retry. Once the keys
    are read, an unknown key is 401."""
    url = f"memory://loading-keys-{tmp_path.name}"
    store = await open_store(url)
    await store.put(
        grant_key("default", hash_secret(SECRET)),
        Grant(workspace="default", name="team", hash=hash_secret(SECRET)).to_json(),
    )
    read_keys = asyncio.Event()
    real_read = KeyWatcher._read

    async def slow_read(self: KeyWatcher, workspace: str) -> int:  # (the store's slow answer)
        await read_keys.wait()
        return await real_read(self, workspace)

    async def endless_load(self: ModelWatcher) -> None:
        self.store_answered.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(KeyWatcher, "_read", slow_read)
    monkeypatch.setattr(ModelWatcher, "start", endless_load)
    frontend = Frontend(FrontendConfig(store_url=url, port=0, cache_dir=tmp_path, auth="keys"))
    starting = asyncio.create_task(frontend.start())
    await wait_for(lambda: frontend.server is not None and frontend.server.port > 0)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat = f"{frontend.url}/v1/chat/completions"

    async def answer(key: str) -> tuple[int, str, str | None]:
        headers = {"Authorization": f"Bearer {key}"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(chat, json=body, headers=headers) as resp,
        ):
            error = (await resp.json())["error"]
            return resp.status, error["code"], resp.headers.get("Retry-After")

    try:
        assert await answer(SECRET) == (503, "keys_loading", "1")
        assert await answer("sk-not-a-key") == (503, "keys_loading", "1")
        read_keys.set()
        await wait_for(lambda: frontend.watcher is not None, message="keys read")
        assert await answer(SECRET) == (503, "discovery_loading", "1")
        assert (await answer("sk-not-a-key"))[:2] == (401, "invalid_api_key")
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await frontend.stop()
        await store.close()
