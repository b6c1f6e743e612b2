"""A real `shoal worker` stays responsive and keeps its lease whatever one request holds."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec

from shoal.worker.engines.mocker.text import VOCAB
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
                await asyncio.sleep(0.05)

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
