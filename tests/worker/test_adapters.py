"""Run-time LoRA adapters on real `shoal worker` processes: loads, conflicts, names, unloads."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

import aiohttp
import openai
import pytest

from shoal.discovery import Discovery
from shoal.store import Store
from shoal.worker.endpoint import adapter_suffix
from shoal.worker.engines.mocker import MockerEngine
from shoal.worker.runtime import Runtime
from tests.processes import Process
from tests.worker.conftest import StartWorker


async def load(http: aiohttp.ClientSession, worker: Process, name: str, path: str) -> Any:
    async with http.post(
        worker.status_url + "/v1/loras", json={"name": name, "path": path}
    ) as resp:
        return resp.status, await resp.json()


async def cards(store: Store) -> dict[str, Any]:
    return {m.card.display_name: m for m in await Discovery(store).list()}


async def chat_status(worker: Process, model: str) -> int:
    client = openai.AsyncOpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    try:
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        return 200
    except openai.APIStatusError as exc:
        return exc.status_code
    finally:
        await client.close()


async def test_reloading_an_adapter_with_another_path_is_refused_and_changes_nothing(
    start_worker: StartWorker, store: Store
) -> None:
    worker = await start_worker("--speedup", "0")
    async with aiohttp.ClientSession() as http:
        assert (await load(http, worker, "ada", "/a"))[0] == 200
        before = (await cards(store))["ada"]

        status, body = await load(http, worker, "ada", "/b")
        assert status == 409, body
        assert body["error"]["param"] == "name" and "/a" in body["error"]["message"]

        assert await chat_status(worker, "ada") == 200
        after = (await cards(store))["ada"]
        assert (after.key, after.card.mdcsum, after.card.source) == (
            before.key,
            before.card.mdcsum,
            "/a",
        )
        for meta in after.card.metadata_files.values():
            async with http.get(meta.url) as resp:
                assert resp.status == 200

        status, body = await load(http, worker, "ada", "/a")
        assert status == 200, "the identical load is idempotent"
        assert body["mdcsum"] == before.card.mdcsum and body["path"] == "/a"


async def test_concurrent_loads_of_one_name_first_wins_identical_loads_succeed(
    start_worker: StartWorker, store: Store
) -> None:
    worker = await start_worker("--speedup", "0")
    async with aiohttp.ClientSession() as http:
        same = await asyncio.gather(*(load(http, worker, "same", "/p") for _ in range(10)))
        assert [status for status, _ in same] == [200] * 10
        assert len({body["mdcsum"] for _, body in same}) == 1

        racing = await asyncio.gather(*(load(http, worker, "race", f"/p{i}") for i in range(10)))
        statuses = sorted(status for status, _ in racing)
        assert statuses == [200] + [409] * 9, statuses
        winner = next(body["path"] for status, body in racing if status == 200)
        assert (await cards(store))["race"].card.source == winner
        async with http.get(worker.status_url + "/v1/loras") as resp:
            listed = {a["name"]: a["path"] for a in (await resp.json())["data"]}
        assert listed == {"same": "/p", "race": winner}


async def test_every_loadable_adapter_name_can_be_unloaded_and_distinct_names_stay_distinct(
    start_worker: StartWorker, store: Store
) -> None:
    worker = await start_worker("--speedup", "0")
    names = ["org/lora", "日本語", "中文", "My-Adapter", "my adapter", "my-adapter"]
    async with aiohttp.ClientSession() as http:
        for name in names:
            status, body = await load(http, worker, name, f"/path/{name}")
            assert status == 200, (name, body)
        announced = await cards(store)
        assert set(announced) == {"mock-model", *names}
        suffixes = {announced[name].key.suffix for name in names}
        assert len(suffixes) == len(names), "one distinct suffix per name"
        for name in names:
            assert await chat_status(worker, name) == 200

        for i, name in enumerate(names):
            target = name if i % 2 else quote(name, safe="")  # raw and percent-encoded
            async with http.delete(f"{worker.status_url}/v1/loras/{target}") as resp:
                assert resp.status == 200, (name, await resp.text())
                assert (await resp.json())["name"] == name
        assert set(await cards(store)) == {"mock-model"}


async def test_a_name_spelling_another_names_hashed_suffix_gets_its_own(
    start_worker: StartWorker, store: Store
) -> None:
    hashed = adapter_suffix("My-Lora")
    assert hashed.startswith("my-lora-") and hashed != "my-lora"
    assert adapter_suffix(hashed) != hashed
    worker = await start_worker("--speedup", "0")
    async with aiohttp.ClientSession() as http:
        for name in ("My-Lora", hashed, "my-lora"):
            status, body = await load(http, worker, name, f"/path/{name}")
            assert status == 200, (name, body)
    announced = await cards(store)
    assert len({announced[n].key.suffix for n in ("My-Lora", hashed, "my-lora")}) == 3


async def test_an_adapter_whose_unload_fails_answers_409_and_stays_announced(
    store_url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = MockerEngine("mock-model", speedup=0)
    async with Runtime(store_url) as runtime:
        await runtime.endpoint("default.backend.generate").serve(engine)
        async with aiohttp.ClientSession() as http:
            async with http.post(
                runtime.status_url + "/v1/loras", json={"name": "sql", "path": "/p"}
            ) as resp:
                assert resp.status == 200
            before = await cards(store)

            async def stuck(name: str) -> None:
                raise RuntimeError("the engine is busy with it")

            monkeypatch.setattr(engine, "unload_adapter", stuck)
            async with http.delete(runtime.status_url + "/v1/loras/sql") as resp:
                assert resp.status == 409
                assert "busy" in (await resp.json())["error"]["message"]
            after = await cards(store)
            assert after["sql"].card == before["sql"].card
            async with http.get(runtime.status_url + "/v1/loras") as resp:
                assert [a["name"] for a in (await resp.json())["data"]] == ["sql"]


async def test_two_unloads_of_one_adapter_at_once_unload_it_once_and_never_announce_it_again(
    store_url: str, store: Store
) -> None:
    """Both find the adapter before either holds the endpoint's lock (a load or the models
    loop holds it): the second then found it gone from the engine, answered 409 "not
    unloaded" and announced it again, a card for an adapter nobody serves."""
    from tests.helpers import wait_for

    engine = MockerEngine("mock-model", speedup=0)
    async with Runtime(store_url) as runtime:
        ep = runtime.endpoint("default.backend.generate")
        await ep.serve(engine)
        async with aiohttp.ClientSession() as http:
            async with http.post(
                runtime.status_url + "/v1/loras", json={"name": "sql", "path": "/p"}
            ) as resp:
                assert resp.status == 200

            async def unload() -> int:
                async with http.delete(runtime.status_url + "/v1/loras/sql") as resp:
                    return resp.status

            async with ep.sync_lock:  # (busy: both wait behind it)
                both = [asyncio.ensure_future(unload()) for _ in range(2)]
                await wait_for(lambda: len(ep.sync_lock._waiters or ()) == 2, message="waiting")
            assert sorted(await asyncio.gather(*both)) == [200, 404]
            assert "sql" not in await cards(store)
            async with http.get(runtime.status_url + "/v1/loras") as resp:
                assert (await resp.json())["data"] == []


async def test_an_adapter_paths_credentials_are_never_listed_published_or_hosted(
    start_worker: StartWorker, store: Store
) -> None:
    """A LoRA `path` with credentials (`https://user:TOKEN@host/...`, a presigned `?sig=`)
    was echoed by `GET /v1/loras`, which needs no token, and written by the mocker into its
    card's `source` and its hosted `adapter_config.json`. They are redacted everywhere now;
    the identical load is still idempotent and another path's 409 names neither secret."""
    secret, signature = "hf_SECRETTOKEN123", "SIGNATURE456"
    path = f"https://user:{secret}@huggingface.co/org/lora?sig={signature}"
    worker = await start_worker("--speedup", "0", "--admin-token", "admintok")
    auth = {"Authorization": "Bearer admintok"}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            worker.status_url + "/v1/loras", json={"name": "my-lora", "path": path}, headers=auth
        ) as resp:
            loaded = await resp.text()
            assert resp.status == 200, loaded
        async with http.get(worker.status_url + "/v1/loras") as resp:  # no token
            listing = await resp.text()
        card = (await cards(store))["my-lora"].card
        hosted = []
        for meta in card.metadata_files.values():
            async with http.get(meta.url) as resp:
                hosted.append(await resp.text())
        async with http.post(
            worker.status_url + "/v1/loras", json={"name": "my-lora", "path": path}, headers=auth
        ) as resp:
            assert resp.status == 200, "the identical load is idempotent"
        async with http.post(
            worker.status_url + "/v1/loras",
            json={"name": "my-lora", "path": path.replace("org", "other")},
            headers=auth,
        ) as resp:
            refused = await resp.text()
            assert resp.status == 409, refused
    assert "https://***@huggingface.co/org/lora?***" in listing, listing
    assert card.source == "https://***@huggingface.co/org/lora?***", card.source
    assert any("huggingface.co/org/lora" in text for text in hosted), hosted
    for shown in (loaded, listing, card.source, refused, *hosted):
        assert secret not in shown and signature not in shown, shown
