"""Losing part of the fleet at once: real mocker workers, the official openai client."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from shoal.frontend import Frontend, FrontendConfig
from tests.helpers import wait_for
from tests.processes import Processes

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
FAST = ("--lease-ttl", "3", "--ttft-ms", "5", "--itl-ms", "2")
WORKERS, KILLED, CLIENTS = 12, 4, 24  # sized for a small, shared machine


@pytest.fixture
async def frontend(tmp_path: Path) -> AsyncIterator[Frontend]:
    # Two retries only: a request in flight on a killed worker spends one, and on a loaded
    # machine a second victim can still take a connection as it dies (its listening socket
    # outlives the kill by a scheduling delay: a reset after the request was sent, which
    # costs an attempt, as a worker crashing on a request must). Every further dead
    # instance it meets must cost nothing (4 are killed).
    config = FrontendConfig(
        store_url=f"sqlite:///{tmp_path / 'store.db'}",
        port=0,
        cache_dir=tmp_path / "cache",
        retries=2,
        inhibit_seconds=10.0,
        drain_timeout=5.0,
    )
    front = Frontend(config)
    await front.start()
    yield front
    await front.stop()


class Clients:
    """Concurrent openai clients in a loop, half streaming, recording every outcome."""

    def __init__(self, url: str) -> None:
        self.client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        self.stop = asyncio.Event()
        self.ok = 0
        self.failed_before_first_byte: list[str] = []

    async def run(self, n: int) -> None:
        while not self.stop.is_set():
            received = 0
            try:
                if n % 2:
                    stream = await self.client.chat.completions.create(
                        model="mock-llm", messages=CHAT, max_tokens=16, stream=True
                    )
                    async for _ in stream:
                        received += 1
                else:
                    await self.client.chat.completions.create(
                        model="mock-llm", messages=CHAT, max_tokens=16
                    )
                self.ok += 1
            except openai.APIError as exc:
                if not received:
                    self.failed_before_first_byte.append(repr(exc))


async def test_losing_a_third_of_the_fleet_fails_no_request_that_had_not_started(
    processes: Processes, frontend: Frontend, tmp_path: Path
) -> None:
    store_url = frontend.config.store_url
    assert store_url is not None
    workers = await asyncio.gather(*(processes.worker(store_url, *FAST) for _ in range(WORKERS)))

    def all_live() -> bool:
        model = frontend.registry.models.get("mock-llm")
        return model is not None and model.live_instances == WORKERS

    await wait_for(all_live, timeout=20, message="every worker served")
    clients = Clients(frontend.url)
    tasks = [asyncio.create_task(clients.run(n)) for n in range(CLIENTS)]
    try:
        await wait_for(lambda: clients.ok >= 100, timeout=30)  # every pool is warm
        for victim in workers[:KILLED]:
            victim.signal(signal.SIGKILL)
        before = clients.ok
        await wait_for(lambda: clients.ok >= before + 300, timeout=60)
    finally:
        clients.stop.set()
        await asyncio.gather(*tasks)
    assert clients.failed_before_first_byte == []
    assert frontend.metrics.instances_inhibited._value.get() >= 1  # the dead ones were met
