"""Real `shoal worker` processes on a SQLite store, driven by the official openai client."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import openai
import pytest

from shoal.cli.common import parse_ready_line
from shoal.discovery import Discovery, Query
from shoal.store import Store
from tests.processes import shoal
from tests.worker.conftest import StartWorker


async def test_openai_client_chats_streams_completes_embeds_and_lists_models(
    start_worker: StartWorker,
) -> None:
    worker = await start_worker("--speedup", "0")
    client = openai.AsyncOpenAI(base_url=worker.url + "/v1", api_key="unused")
    try:
        chat = await client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        text = chat.choices[0].message.content
        assert text and len(text.split()) == 8
        assert chat.usage is not None and chat.usage.completion_tokens == 8

        stream = await client.chat.completions.create(
            model="mock-model",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(pieces) == text
        assert usage is not None and usage.total_tokens == chat.usage.total_tokens

        completion = await client.completions.create(
            model="mock-model", prompt="once", max_tokens=5
        )
        assert completion.choices[0].finish_reason == "length"
        assert len(completion.choices[0].text.split()) == 5

        embedding = await client.embeddings.create(model="mock-model", input=["a", "b"])
        assert len(embedding.data) == 2 and len(embedding.data[0].embedding) == 256

        models = await client.models.list()
        assert [m.id async for m in models] == ["mock-model"]

        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]
            )
    finally:
        await client.close()


async def test_workers_are_listed_in_discovery_as_their_ready_lines_say(
    start_worker: StartWorker, store: Store
) -> None:
    a, b, other = await asyncio.gather(
        start_worker("--namespace", "team-a"),
        start_worker("--namespace", "team-a"),
        start_worker("--namespace", "team-b", model="other-model"),
    )

    models = await Discovery(store).list(Query(namespace="team-a"))
    assert {(m.instance_id, m.url, m.instance.status_url) for m in models} == {
        (a.instance_id, a.url, a.status_url),
        (b.instance_id, b.url, b.status_url),
    }
    assert {m.card.display_name for m in models} == {"mock-model"}
    assert len({m.card.mdcsum for m in models}) == 1, "same model, same mdcsum"
    everything = await Discovery(store).list()
    assert {m.instance_id for m in everything} == {a.instance_id, b.instance_id, other.instance_id}


async def test_every_flag_falls_back_to_its_environment_variable(
    store_url: str, store: Store
) -> None:
    env = {
        **os.environ,
        "SHOAL_MODEL": "env-model",
        "SHOAL_STORE": store_url,
        "SHOAL_NAMESPACE": "from-env",
        "SHOAL_COMPONENT": "comp",
        "SHOAL_ENDPOINT": "ep",
        "SHOAL_SPEEDUP": "0",
    }
    proc = await shoal(
        "worker", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        ready = parse_ready_line(line.decode(), "worker")
        assert ready is not None and ready["model"] == "env-model"
        models = await Discovery(store).list(Query("from-env", "comp", "ep"))
        assert [m.card.display_name for m in models] == ["env-model"]
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 15) == 0


async def test_status_server_answers_live_health_and_metrics(start_worker: StartWorker) -> None:
    worker = await start_worker("--speedup", "0")
    async with aiohttp.ClientSession() as http:
        async with http.get(worker.status_url + "/live") as resp:
            assert resp.status == 200
        async with http.get(worker.status_url + "/health") as resp:
            assert resp.status == 200
            body = await resp.json()
            assert body["instance_id"] == f"{worker.instance_id:x}"
            assert body["endpoints"][0]["models"][0]["name"] == "mock-model"
        async with http.post(
            worker.url + "/v1/chat/completions",
            json={
                "model": "mock-model",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 3,
            },
        ) as resp:
            assert resp.status == 200
        async with http.get(worker.status_url + "/metrics") as resp:
            text = await resp.text()
    assert (
        'shoal_worker_requests_total{endpoint="default.backend.generate",route="/v1/chat/completions",status="200"} 1.0'
        in text
    )
    assert "shoal_worker_lease_held 1.0" in text
    assert "shoal_mocker_active_sequences{" in text and "shoal_mocker_kv_usage_ratio{" in text
    assert (
        'shoal_mocker_generation_tokens_total{endpoint="default.backend.generate",model="mock-model"} 3.0'
        in text
    )


async def test_worker_with_unreachable_store_exits_1_with_a_message(
    start_worker: StartWorker,
) -> None:
    with pytest.raises(AssertionError, match="exited with 1") as info:
        await start_worker(store="sqlite:///dev/null/not-a-dir/store.db")
    assert "sqlite:///dev/null/not-a-dir/store.db" in str(info.value)
