"""Frontends reading the relay's stream (`--kv-events nats://...`) against one reading the
workers' own ZMQ sockets: three mocker workers, a real `nats-server -js`, a `shoal kv-relay`
process. The stream frontend's index holds what the ZMQ one holds, it routes a repeated
prompt where it is cached, it catches up from the stream when started late, and after a NATS
outage it holds the workers' caches again (what NATS missed is replayed from the workers)."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest

from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.kv.router import KvRouter
from shoal.kv import token_block_hashes
from shoal.worker.engines.mocker.text import VOCAB
from shoal.worker.engines.mocker.tokenizer import encode, render_chat
from tests.helpers import wait_for
from tests.nats_server import NatsServer
from tests.processes import Process, Processes

MODEL = "stream-llm"
BS = 4
WORKER_FLAGS = (
    "--lease-ttl", "2", "--ttft-ms", "1", "--itl-ms", "1",
    "--block-size", str(BS), "--kv-blocks", "64", "--kv-events-port", "0",
)  # fmt: skip


def text(seed: int, words: int = 120) -> str:
    return " ".join(VOCAB[(seed * 7 + i * i + i * seed) % 20] for i in range(words))


async def send(url: str, prompt: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1
    )


async def complete(url: str, prompt: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)


async def chat_requests(worker: Process) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{worker.status_url}/metrics") as r:
        body = await r.text()
    match = re.search(r'^shoal_mocker_requests_total\{[^}]*kind="chat"[^}]*\} (\S+)$', body, re.M)
    return 0 if match is None else int(float(match.group(1)))


def router(front: Frontend) -> KvRouter:
    assert isinstance(front.router, KvRouter)
    return front.router


def holders(front: Frontend) -> dict[int, frozenset[int]]:
    """The frontend's index: block hash -> instances holding it."""
    state = next(iter(router(front).tracker.sets.values()), None)
    if state is None:
        return {}
    return {h: frozenset(i) for h, i in state.index.holders.items() if i}


def overlaps(front: Frontend, prompt: str | list[int]) -> dict[int, int]:
    """Instance id -> blocks of `prompt` (a chat's text, or token ids) the frontend's index
    says it holds."""
    state = next(iter(router(front).tracker.sets.values()))
    if isinstance(prompt, str):
        prompt = encode(render_chat([_Msg("user", prompt)]))
    return state.index.overlaps(token_block_hashes(prompt, BS))


class _Msg:
    def __init__(self, role: str, content: str) -> None:
        self.role, self.content = role, content


@dataclass
class Site:
    store_url: str
    namespace: str
    workers: list[Process]
    nats: NatsServer
    relays: list[Process]  # two, as run for availability
    tmp: Path

    async def frontend(self, kv_events: str | None) -> Frontend:
        config = FrontendConfig(
            store_url=self.store_url,
            port=0,
            namespaces=(self.namespace,),
            router="kv",
            reconcile_interval=1.0,
            cache_dir=self.tmp / f"cache-{uuid.uuid4().hex[:6]}",
            kv_events=kv_events,
        )
        front = Frontend(config)
        await front.start()

        def ready() -> bool:
            state = next(iter(router(front).tracker.sets.values()), None)
            model = front.registry.models.get(MODEL)
            return (
                model is not None
                and model.live_instances == len(self.workers)
                and state is not None
                and state.tokenizer is not None
            )

        await wait_for(ready, timeout=30, message="workers joined and the tokenizer loaded")
        return front


@pytest.fixture
async def site(
    processes: Processes, tmp_path: Path, nats_server: NatsServer
) -> AsyncIterator[Site]:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    namespace = f"stream-{uuid.uuid4().hex[:8]}"
    workers = [
        await processes.worker(store_url, "--namespace", namespace, *WORKER_FLAGS, model=MODEL)
        for _ in range(3)
    ]
    relay_args = (
        "kv-relay", "--store", store_url, "--namespace", namespace, "--nats", nats_server.url,
        "--status-port", "0", "--buffer", "4",
    )  # fmt: skip
    relays = [await processes.start(*relay_args, ready="kv-relay") for _ in range(2)]
    yield Site(store_url, namespace, workers, nats_server, relays, tmp_path)


async def relay_metric(relay: Process, name: str) -> float:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{relay.ready['status']}/metrics") as resp,
    ):
        body = await resp.text()
    match = re.search(rf"^shoal_relay_{name} (\S+)$", body, re.M)
    assert match is not None, body
    return float(match.group(1))


async def test_a_late_frontend_reading_the_stream_indexes_and_routes_as_one_reading_zmq(
    site: Site,
) -> None:
    a, b, c = site.workers
    for i, worker in enumerate(site.workers):  # cached before any frontend starts
        await send(worker.url, text(i))
    zmq_front = await site.frontend(None)
    stream_front = await site.frontend(site.nats.url)
    other_front = await site.frontend(site.nats.url)
    try:
        await wait_for(
            lambda: (
                holders(zmq_front)
                and holders(stream_front) == holders(zmq_front)
                and holders(other_front) == holders(zmq_front)
            ),
            timeout=15,
            message="the stream frontends caught up to the ZMQ one",
        )
        tracker = router(stream_front).tracker
        health = router(stream_front).describe()["kv_events"]
        assert health["connected"] and health["error"] is None, health
        assert tracker.stats.replays == 0  # caught up from the stream, no worker asked
        assert all(t.subscription is None for t in tracker._tracked.values())

        # Live events, then a repeated prompt through the stream frontend lands where cached.
        prompt = text(7, 160)
        await send(b.url, prompt)
        await wait_for(
            lambda: holders(stream_front) == holders(zmq_front) and len(holders(stream_front)) > 0,
            timeout=10,
            message="live events indexed alike",
        )
        for front in (stream_front, other_front):
            before = [await chat_requests(w) for w in (a, b, c)]
            await send(front.url, prompt)
            after = [await chat_requests(w) for w in (a, b, c)]
            assert [x - y for x, y in zip(after, before, strict=True)] == [0, 1, 0]
    finally:
        await other_front.stop()
        await stream_front.stop()
        await zmq_front.stop()


async def test_after_a_nats_outage_the_stream_index_converges_to_the_workers_caches(
    site: Site,
) -> None:
    a = site.workers[0]
    zmq_front = await site.frontend(None)  # its index: the workers' caches, read from them
    stream_front = await site.frontend(site.nats.url)
    try:
        await send(a.url, text(1))
        await wait_for(
            lambda: holders(zmq_front) and holders(stream_front) == holders(zmq_front),
            timeout=15,
            message="indexed alike before the outage",
        )
        site.nats.stop()
        # More batches than a relay's queue holds (4), blocks evicted among them (64 kept).
        for seed in range(2, 12):
            await send(a.url, text(seed))
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{site.relays[0].ready['status']}/health") as resp,
        ):
            body = await resp.json()
            assert resp.status == 503 and "nats" in body["unhealthy"], body
        site.nats.start()
        await send(a.url, text(20))
        await wait_for(
            lambda: holders(stream_front) == holders(zmq_front),
            timeout=30,
            message="the stream index converged to the workers' caches",
        )
        # The workers still had the batches NATS missed: replayed, not lost.
        for relay in site.relays:
            assert await relay_metric(relay, "resnapshots_total") == 0
            assert await relay_metric(relay, "dropped_batches_total") == 0
        assert router(stream_front).tracker.stats.resnapshots == 0

        prompt = " ".join(reversed(text(30, 160).split()))  # and live events flow again
        await complete(a.url, prompt)
        tokens = encode(prompt)
        await wait_for(
            lambda: (
                overlaps(zmq_front, tokens).get(a.instance_id)
                and holders(stream_front) == holders(zmq_front)
            ),
            timeout=10,
            message="new blocks indexed after the outage",
        )
    finally:
        await stream_front.stop()
        await zmq_front.stop()
