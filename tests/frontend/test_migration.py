"""Streams that survive their worker (issue 27): real `shoal` processes, the official `openai`
client. A worker dies mid-stream (`--die-after-tokens`, a SIGKILL of itself); the gateway
continues the stream on another instance, and the client sees one stream with the text of
an undisturbed run."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from shoal.worker.engines.mocker import MockerEngine
from tests.faults.support import routes_exactly, until
from tests.processes import Process, Processes

MODEL = "mock-llm"
FAST = ("--lease-ttl", "2", "--ttft-ms", "5", "--itl-ms", "10")


class Fleet:
    def __init__(self, processes: Processes, tmp: Path) -> None:
        self.processes = processes
        self.store = f"sqlite:///{tmp / 'store.db'}"
        self.tmp = tmp
        self.workers: list[Process] = []

    async def worker(self, *args: str) -> Process:
        worker = await self.processes.worker(self.store, *FAST, *args, model=MODEL)
        self.workers.append(worker)
        return worker

    async def frontend(self, *args: str) -> Process:
        front = await self.processes.start(
            "frontend", "--store", self.store, "--port", "0", "--reconcile-interval", "1",
            "--first-byte-timeout", "5", "--cache-dir", str(self.tmp / "cache"), *args,
            ready="frontend",
        )  # fmt: skip
        ids = {w.instance_id for w in self.workers}
        await until(lambda: routes_exactly(front.url, ids), 20, "every worker routed")
        return front


@pytest.fixture
def fleet(processes: Processes, tmp_path: Path) -> Fleet:
    return Fleet(processes, tmp_path)


@pytest.fixture
async def reference() -> AsyncIterator[openai.AsyncOpenAI]:
    """An undisturbed mocker (in-process, answering at once): the texts streams must have."""
    engine = MockerEngine(MODEL, speedup=0)
    await engine.start()
    client: TestClient[Any, Any] = TestClient(TestServer(engine.app()))
    await client.start_server()
    yield openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused")
    await client.close()
    await engine.stop()


def _client(front: Process) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0)


async def _chat_stream(client: openai.AsyncOpenAI, i: int, max_tokens: int) -> dict[str, Any]:
    """One streamed chat: its text, ids, created, usage and how many content chunks."""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell me story {i}."}],
        seed=i,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    out: dict[str, Any] = {"text": "", "ids": set(), "created": set(), "usage": None, "chunks": 0}
    out["roles"] = 0
    async for chunk in stream:
        out["ids"].add(chunk.id)
        out["created"].add(chunk.created)
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                out["roles"] += 1
            if choice.delta.content:
                out["text"] += choice.delta.content
                out["chunks"] += 1
    return out


async def _chat_whole(client: openai.AsyncOpenAI, i: int, max_tokens: int) -> str:
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell me story {i}."}],
        seed=i,
        temperature=0,
        max_tokens=max_tokens,
    )
    return answer.choices[0].message.content or ""


async def _completion_stream(client: openai.AsyncOpenAI, i: int, max_tokens: int) -> str:
    stream = await client.completions.create(
        model=MODEL, prompt=f"Once upon a time {i}", seed=i, max_tokens=max_tokens, stream=True
    )
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


async def _reference_text(reference: openai.AsyncOpenAI, i: int, max_tokens: int) -> str:
    answer = await reference.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell me story {i}."}],
        seed=i,
        temperature=0,
        max_tokens=max_tokens,
    )
    return answer.choices[0].message.content or ""


async def _metric(front: Process, outcome: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{front.url}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("shoal_frontend_migrations_total{") and f'outcome="{outcome}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_streams_on_a_worker_that_dies_complete_with_the_text_of_an_undisturbed_run(
    fleet: Fleet, reference: openai.AsyncOpenAI
) -> None:
    dying = await fleet.worker("--die-after-tokens", "10")
    await fleet.worker()
    await fleet.worker()
    front = await fleet.frontend()
    client = _client(front)
    results, completions, whole = await asyncio.gather(
        asyncio.gather(*(_chat_stream(client, i, 30) for i in range(10))),
        asyncio.gather(*(_completion_stream(client, i, 30) for i in range(4))),
        asyncio.gather(*(_chat_whole(client, i, 30) for i in range(3))),
    )
    assert await dying.wait(10) != 0  # it did die (SIGKILL)
    for i, text in enumerate(whole):  # not streamed: retried from scratch, before a byte
        assert text == await _reference_text(reference, i, 30), i
    for i, text in enumerate(completions):
        answer = await reference.completions.create(
            model=MODEL, prompt=f"Once upon a time {i}", seed=i, max_tokens=30
        )
        assert text == answer.choices[0].text, i
    for i, result in enumerate(results):
        assert result["text"] == await _reference_text(reference, i, 30), i
        assert len(result["ids"]) == 1 and len(result["created"]) == 1
        assert result["roles"] == 1
        assert result["usage"].completion_tokens == result["chunks"] == 30
    assert await _metric(front, "attempted") >= 1
    assert await _metric(front, "succeeded") == await _metric(front, "attempted")
    assert await _metric(front, "refused") == 0


async def _probe_until(front: Process, instance: Process) -> None:
    """Send one-token answers (which kill no worker) until `instance` took one: round-robin
    then sends the next request to the instance after it, the retry to the one after that."""
    async with aiohttp.ClientSession() as session:
        for _ in range(10):
            body = {"model": MODEL, "prompt": "probe", "max_tokens": 1}
            async with session.post(f"{front.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                if int(resp.headers["x-shoal-instance"], 16) == instance.instance_id:
                    return
    raise AssertionError("the probe never reached the instance")


@pytest.mark.parametrize("limit", [1, 2])
async def test_a_stream_whose_worker_dies_twice_needs_a_migration_limit_of_two(
    fleet: Fleet, reference: openai.AsyncOpenAI, limit: int
) -> None:
    healthy = await fleet.worker()
    for _ in range(2):
        await fleet.worker("--die-after-tokens", "8")
    front = await fleet.frontend("--migration-limit", str(limit), "--router", "round-robin")
    await _probe_until(front, healthy)  # the stream starts on one dying worker, then the other
    client = _client(front)
    if limit == 1:
        with pytest.raises(openai.APIError, match="failed while streaming"):
            await _chat_stream(client, 1, 30)
        assert await _metric(front, "refused") == 1
    else:
        result = await _chat_stream(client, 1, 30)
        assert result["text"] == await _reference_text(reference, 1, 30)
        assert result["usage"].completion_tokens == 30
    assert await _metric(front, "attempted") == 1 if limit == 1 else 2


async def test_streams_cut_by_a_drain_that_outlives_its_timeout_complete_elsewhere(
    fleet: Fleet, reference: openai.AsyncOpenAI
) -> None:
    draining = await fleet.worker("--drain-timeout", "0.3")
    await fleet.worker()
    front = await fleet.frontend()
    client = _client(front)
    streams = [asyncio.create_task(_chat_stream(client, i, 150)) for i in range(4)]
    await until(lambda: _metric_started(front), 10, "streams under way")
    draining.signal(signal.SIGTERM)  # its streams run past the drain timeout: it cuts them
    results = await asyncio.gather(*streams)
    assert await draining.wait(10) == 0
    for i, result in enumerate(results):
        assert result["text"] == await _reference_text(reference, i, 150), i
        assert result["usage"].completion_tokens == 150
    assert await _metric(front, "attempted") >= 1


async def _metric_started(front: Process) -> bool:
    async with aiohttp.ClientSession() as session, session.get(f"{front.url}/metrics") as resp:
        text = await resp.text()
    return 'shoal_frontend_time_to_first_token_seconds_count{model="mock-llm"} 4.0' in text


async def test_a_stream_of_several_tokens_a_chunk_continues_with_the_tokens_its_usage_counts(
    fleet: Fleet, reference: openai.AsyncOpenAI
) -> None:
    """What was wrong: a migration counted one token per chunk it had passed on, so a worker
    sending several tokens a chunk (`--stream-interval`, as engines batch their output) had
    its stream continued with more tokens asked than were left: 3 tokens a chunk, killed
    after 9, the continuation asked for 27 more and the client got 36 tokens of its
    `max_tokens` 30. What holds now: the usage in the stream (vLLM's
    `continuous_usage_stats`) counts the tokens, and the client gets 30: the text of an
    undisturbed run."""
    healthy = await fleet.worker("--stream-interval", "3")
    dying = await fleet.worker("--stream-interval", "3", "--die-after-tokens", "9")
    front = await fleet.frontend("--router", "round-robin")
    await _probe_until(front, healthy)  # the stream starts on the dying worker
    stream = await _client(front).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me story 1."}],
        seed=1,
        temperature=0,
        max_tokens=30,
        stream=True,
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    text, usages = "", []
    async for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage.completion_tokens)
        for choice in chunk.choices:
            text += choice.delta.content or ""
    assert await dying.wait(10) != 0  # it did die (SIGKILL)
    assert await _metric(front, "attempted") == 1
    assert text == await _reference_text(reference, 1, 30)
    assert usages[-1] == 30 and usages[:3] == [3, 6, 9]
