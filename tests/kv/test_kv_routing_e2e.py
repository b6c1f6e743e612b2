"""End to end: three `shoal worker` mocker processes publishing KV events, a frontend with
`--router kv`, the official openai client. A prompt goes where its blocks are cached, and
a worker's eviction events move it elsewhere."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
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
from tests.processes import Process, Processes

MODEL = "kv-llm"
BS = 16
# 64 blocks per worker: one long prompt fits, two do not.
WORKER_FLAGS = (
    "--lease-ttl", "2", "--ttft-ms", "1", "--itl-ms", "1",
    "--block-size", str(BS), "--kv-blocks", "64", "--kv-events-port", "0",
)  # fmt: skip
WORDS = VOCAB[:20]  # the mocker's own words: one token each


def long_text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * i + i * seed) % len(WORDS)] for i in range(words))


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture
async def fleet(
    processes: Processes, tmp_path: Path
) -> AsyncIterator[tuple[Frontend, list[Process]]]:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    namespace = f"kv-{uuid.uuid4().hex[:8]}"
    workers = [
        await processes.worker(store_url, "--namespace", namespace, *WORKER_FLAGS, model=MODEL)
        for _ in range(3)
    ]
    config = FrontendConfig(
        store_url=store_url,
        port=0,
        namespaces=(namespace,),
        router="kv",
        reconcile_interval=1.0,
        cache_dir=tmp_path / "cache",
    )
    front = Frontend(config)
    await front.start()
    router = front.router
    assert isinstance(router, KvRouter)

    def ready() -> bool:
        state = next(iter(router.tracker.sets.values()), None)
        model = front.registry.models.get(MODEL)
        return (
            model is not None
            and model.live_instances == 3
            and state is not None
            and state.tokenizer is not None
        )

    await wait_for(ready, timeout=30, message="3 workers joined and the tokenizer loaded")
    yield front, workers
    await front.stop()


async def chat_requests(worker: Process) -> int:
    """How many chat requests the worker served, from its own metrics."""
    async with aiohttp.ClientSession() as session, session.get(f"{worker.status_url}/metrics") as r:
        text = await r.text()
    match = re.search(r'^shoal_mocker_requests_total\{[^}]*kind="chat"[^}]*\} (\S+)$', text, re.M)
    assert match is not None, text
    return int(float(match.group(1)))


async def send_direct(worker: Process, text: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0)
    await client.chat.completions.create(model=MODEL, messages=chat(text), max_tokens=1)  # type: ignore[arg-type]


def holders(front: Frontend, text: str) -> dict[int, int]:
    """Instance id -> prompt blocks the frontend's index says it holds."""
    router = front.router
    assert isinstance(router, KvRouter)
    state = next(iter(router.tracker.sets.values()))
    tokens = encode(render_chat([_Msg("user", text)]))
    return state.index.overlaps(token_block_hashes(tokens, BS))


class _Msg:
    def __init__(self, role: str, content: str) -> None:
        self.role, self.content = role, content


async def test_a_repeated_prompt_lands_where_it_is_cached_and_eviction_moves_it(
    fleet: tuple[Frontend, list[Process]],
) -> None:
    front, (a, b, c) = fleet
    client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
    prompt = long_text(1, 500)  # ~40 blocks
    blocks = len(encode(render_chat([_Msg("user", prompt)]))) // BS
    assert 30 < blocks < 64

    # Cached on `a` behind the frontend's back: only a's KV events can tell.
    await send_direct(a, prompt)
    await wait_for(lambda: holders(front, prompt) == {a.instance_id: blocks}, message="indexed")
    before = [await chat_requests(w) for w in (a, b, c)]
    for _ in range(4):
        await client.chat.completions.create(model=MODEL, messages=chat(prompt), max_tokens=1)  # type: ignore[arg-type]
    after = [await chat_requests(w) for w in (a, b, c)]
    assert [x - y for x, y in zip(after, before, strict=True)] == [4, 0, 0]

    # Now b caches it too, and a evicts it (another long prompt fills a's 64 blocks).
    await send_direct(b, prompt)
    await send_direct(a, long_text(2, 800))
    await wait_for(
        lambda: holders(front, prompt) == {b.instance_id: blocks},
        message="a's eviction events applied",
    )
    before = [await chat_requests(w) for w in (a, b, c)]
    await client.chat.completions.create(model=MODEL, messages=chat(prompt), max_tokens=1)  # type: ignore[arg-type]
    after = [await chat_requests(w) for w in (a, b, c)]
    assert [x - y for x, y in zip(after, before, strict=True)] == [0, 1, 0]
