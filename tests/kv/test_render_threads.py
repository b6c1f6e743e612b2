"""Render threads (`PromptTokenizer.submit`) are bounded for the whole process, whatever the
number of worker sets: a set's thread ends once it has no work left, no more than
`RENDER_THREADS` run at once, none is started on the event loop, and a set that finds none
free has its chat routed by prefix, not failed. Real tokenizers, real threads, a real
frontend over mocker workers."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tokenizers import Tokenizer

from shoal.frontend import Frontend
from shoal.frontend.kv.prompt import (
    INLINE_MESSAGES,
    RENDER_THREADS,
    PromptTokenizer,
    prompt_chain,
)
from shoal.worker.engines.mocker.text import VOCAB
from shoal.worker.engines.mocker.tokenizer import CHAT_TEMPLATE, TOKENIZER
from tests.helpers import LoopTurns, wait_for
from tests.kv.test_untrusted_prompts import MODEL, figures, kv_set, start_front
from tests.processes import Processes

SETS = 200
BLOCK_SIZE = 16


def render_threads() -> int:
    """The render threads alive in this process now."""
    return sum(t.name.startswith("kv-tokenizer") for t in threading.enumerate())


def long_chat(i: int) -> list[dict[str, str]]:
    """A chat past the event loop's bounds (`INLINE_MESSAGES`): what is left to a thread."""
    return [
        {"role": "user", "content": " ".join(VOCAB[(i + k + j) % 40] for j in range(4))}
        for k in range(INLINE_MESSAGES + 44)
    ]


def tokenizers(n: int) -> list[PromptTokenizer]:
    """`n` worker sets' tokenizers around one shared `tokenizers.Tokenizer`, as the tracker
    makes them for adapters of one base."""
    shared = Tokenizer.from_str(TOKENIZER.to_str())
    chain = prompt_chain(shared)
    return [PromptTokenizer(shared, {"chat_template": CHAT_TEMPLATE}, chain) for _ in range(n)]


async def test_render_threads_stay_under_the_cap_and_end_when_idle_however_many_sets() -> None:
    """Counted: the threads alive when each chat runs, and where `Thread.start` was called
    (a start waits for the GIL: the event loop never calls it, but once for the starter)."""
    sets = tokenizers(SETS)
    starts = LoopTurns().wrap(threading.Thread, "start")
    reference = tokenizers(1)[0]
    expected = [reference.chat_hashes(long_chat(i), [BLOCK_SIZE], 64) for i in range(SETS)]
    peak = [0]

    def hashes(tokenizer: PromptTokenizer, i: int) -> Any:
        peak[0] = max(peak[0], render_threads())
        return tokenizer.chat_hashes(long_chat(i), [BLOCK_SIZE], 64)

    jobs: dict[int, Future[Any]] = {}
    refused = 0
    deadline = time.monotonic() + 60
    try:
        for i, tokenizer in enumerate(sets):  # a burst: each set's deferred chat at once
            while i not in jobs:
                assert time.monotonic() < deadline, f"{len(jobs)} of {SETS} sets got a thread"
                try:
                    jobs[i] = tokenizer.submit(hashes, tokenizer, i)
                except RuntimeError:  # none free: the router routes this chat by prefix
                    refused += 1
                    await wait_for(lambda: render_threads() < RENDER_THREADS, timeout=30)
        results = [await asyncio.wrap_future(jobs[i]) for i in range(SETS)]
        assert results == expected  # the same hashes as prepared in the caller's thread
        assert peak[0] <= RENDER_THREADS, f"{peak[0]} render threads at once"
        # Idle: every set's thread ends (none kept for the life of the set).
        await wait_for(lambda: render_threads() == 0, timeout=10, message="threads ended")
    finally:
        await starts.stop()
        for tokenizer in sets:
            tokenizer.close()
    assert starts.on_loop <= 1 and starts.off_loop >= SETS // RENDER_THREADS


async def test_one_sets_chats_run_in_its_one_thread_in_order() -> None:
    """A bad template occupies at most one thread: a set's queued chats wait for its
    thread, they never take another one."""
    (tokenizer,) = tokenizers(1)
    started, release = threading.Event(), threading.Event()
    ran: list[tuple[int, int]] = []  # (chat, thread)

    def chat(i: int) -> None:
        ran.append((i, threading.get_ident()))
        if i == 0:
            started.set()
            release.wait(10)

    try:
        jobs = [tokenizer.submit(chat, 0)]
        await asyncio.to_thread(started.wait, 10)
        jobs += [tokenizer.submit(chat, i) for i in range(1, 6)]
        assert render_threads() == 1
        release.set()
        for job in jobs:
            await asyncio.wrap_future(job)
        assert [i for i, _ in ran] == list(range(6))
        assert len({thread for _, thread in ran}) == 1
        await wait_for(lambda: render_threads() == 0, timeout=10, message="its thread ended")
    finally:
        release.set()
        tokenizer.close()


@pytest.fixture
async def front(processes: Processes, tmp_path: Path) -> AsyncIterator[Frontend]:
    front = await start_front(processes, tmp_path)
    yield front
    await front.stop()


async def test_a_chat_that_finds_every_render_thread_busy_is_routed_by_prefix(
    front: Frontend,
) -> None:
    others = tokenizers(RENDER_THREADS)
    release = threading.Event()
    busy = [t.submit(release.wait, 30) for t in others]  # other sets' slow renders
    body = {"model": MODEL, "messages": long_chat(0), "max_tokens": 1}
    url = f"{front.url}/v1/chat/completions"

    async def post() -> int:
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
            text = await r.text()
            assert r.status == 200, text
            return r.status

    routed: Callable[[], int] = lambda: figures(front).picks  # noqa: E731
    try:
        await wait_for(lambda: render_threads() >= RENDER_THREADS, message="cap taken")
        picks, fallbacks = routed(), figures(front).fallbacks
        assert await post() == 200  # not failed,
        assert figures(front).fallbacks == fallbacks + 1 and routed() == picks  # by prefix
        async with aiohttp.ClientSession() as session, session.get(f"{front.url}/metrics") as r:
            assert "shoal_frontend_kv_no_render_thread_total 1.0" in await r.text()
        release.set()
        for job in busy:
            await asyncio.wrap_future(job)
        await wait_for(lambda: render_threads() == 0, timeout=10, message="threads ended")
        assert await post() == 200
        assert routed() == picks + 1  # a thread free again: routed by its KV blocks
        assert kv_set(front).tokenizer is not None and kv_set(front).tokenizer.renders  # type: ignore[union-attr]
    finally:
        release.set()
        for tokenizer in others:
            tokenizer.close()


async def test_a_chat_whose_render_thread_the_system_refuses_is_routed_by_prefix(
    front: Frontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a container at its pids limit does: `can't start new thread`."""
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith("kv-tokenizer"):
            raise RuntimeError("can't start new thread")
        real_start(thread)

    body = {"model": MODEL, "messages": long_chat(1), "max_tokens": 1}
    url = f"{front.url}/v1/chat/completions"
    picks, fallbacks = figures(front).picks, figures(front).fallbacks
    monkeypatch.setattr(threading.Thread, "start", start)
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
    assert figures(front).fallbacks == fallbacks + 1 and figures(front).picks == picks
    assert figures(front).no_thread == 1
    monkeypatch.setattr(threading.Thread, "start", real_start)
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
    assert figures(front).picks == picks + 1  # the next chat gets its thread


async def test_a_chat_whose_request_stopped_waiting_is_never_rendered_after(
    front: Frontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request waits `PREPARE_WAIT` for its chat's tokens, then is routed by prefix: the
    render queued for it behind a slow one is of no use to anyone. They all ran, one after
    the other, in the set's thread: its render slot held, and the set's next chats queued
    behind them (each waiting its full `PREPARE_WAIT`), for as long as the backlog lasted.
    Counted: the renders that run once the slow one lets go, after every request was answered."""
    state = kv_set(front)
    tokenizer = state.tokenizer
    assert tokenizer is not None
    real_render, release = tokenizer.render, threading.Event()
    rendered = [0]

    def render(messages: list[Any], *, inline: bool = False) -> str:
        if not inline:
            rendered[0] += 1
            release.wait(30)  # the first: slow; the others queue behind it
        return real_render(messages, inline=inline)

    monkeypatch.setattr(tokenizer, "render", render)
    url = f"{front.url}/v1/chat/completions"

    async def post(i: int) -> None:
        body = {"model": MODEL, "messages": long_chat(i), "max_tokens": 1}
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
            assert r.status == 200, await r.text()

    try:
        await asyncio.gather(*(post(i) for i in range(12)))  # each routed by prefix at last
        assert figures(front).slow_prepares == 12 and rendered[0] == 1
        release.set()
        await wait_for(lambda: render_threads() == 0, timeout=10, message="its thread ended")
        assert rendered[0] == 1, f"{rendered[0] - 1} chats rendered for requests long answered"
        picks = figures(front).picks
        await post(99)  # the set's next chat has the thread at once: routed by its KV blocks
        assert figures(front).picks == picks + 1 and rendered[0] == 2
    finally:
        release.set()
