"""A real `shoal worker` stays responsive and keeps its lease whatever one request holds."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec

from shoal.worker.engines.mocker.text import VOCAB
from tests.helpers import refused_past, wait_for
from tests.worker.conftest import StartWorker


async def test_a_16_mb_chat_leaves_live_answering_and_the_worker_keeps_its_lease(
    start_worker: StartWorker,
) -> None:
    worker = await start_worker("--speedup", "0", "--lease-ttl", "3")
    words = " ".join(VOCAB[i % len(VOCAB)] for i in range(3_000_000))[:16_000_000]
    body = msgspec.json.encode(
        {"model": "mock-model", "messages": [{"role": "user", "content": words}]}
    )
    assert 15_000_000 < len(body) < 16 * 1024 * 1024
    slowest = 0.0

    async with aiohttp.ClientSession() as http:

        async def probe_live(done: asyncio.Event) -> None:
            nonlocal slowest
            while not done.is_set():
                started = time.monotonic()
                async with http.get(worker.status_url + "/live") as response:
                    assert response.status == 200
                slowest = max(slowest, time.monotonic() - started)
                await asyncio.sleep(0.05)  # the probe's period, not a synchronisation

        done = asyncio.Event()
        probe = asyncio.create_task(probe_live(done))
        try:
            async with http.post(
                worker.url + "/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as response:
                answer = await response.json()
                assert response.status == 400, answer
                assert answer["error"]["code"] == "context_length_exceeded"
        finally:
            done.set()
            await probe
        async with http.get(worker.status_url + "/health") as response:
            health = await response.json()
    assert slowest < 1.0, f"/live took {slowest:.2f}s while the big prompt was handled"
    assert int(health["instance_id"], 16) == worker.instance_id, health


async def test_silent_connections_past_the_status_servers_limit_are_refused_and_chats_still_answer(
    start_worker: StartWorker,
) -> None:
    """The status server took any number of connections that never send a byte, each kept
    for aiohttp's keep-alive of 3,630 s: 1,100 of them used up a 1,024-fd worker and its chats
    failed. Now past its 128 it answers 503 `too_many_connections` and closes; the worker
    still serves chats and probes once they go."""
    worker = await start_worker("--speedup", "0")
    host, port = worker.status_url.removeprefix("http://").rsplit(":", 1)
    held = await refused_past(host, int(port), 128)
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                worker.url + "/v1/chat/completions",
                json={
                    "model": "mock-model",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
            ) as response,
        ):
            assert response.status == 200, await response.text()
    finally:
        for _, held_writer in held:
            held_writer.close()

    async def live() -> bool:
        async with aiohttp.ClientSession() as http, http.get(worker.status_url + "/live") as r:
            return r.status == 200

    await wait_for(live, message="/live never answered once the silent connections went")
