"""One client's request affects only itself in two stages: a prefill answer made long by what
the request asked for (`n` choices, as vLLM answers them) fails that request, and no prefill
instance is taken out of routing for it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from shoal.cards import WorkerRole
from shoal.frontend import Frontend
from shoal.frontend.proxy.disagg import MAX_PREFILL_ANSWER
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import FakeWorker
from tests.helpers import wait_for


class ChoicesPrefill(FakeWorker):
    """A prefill that answers the `n` choices a request asks for, one token each, as vLLM
    does (the plain fake answers one)."""

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        self.requests += 1
        data = json.loads(await request.read())
        n = int(data.get("n", 1))
        choice = {"message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
        return web.json_response(
            {
                "id": "prefill",
                "object": kind,
                "created": 0,
                "model": data["model"],
                "choices": [{"index": i, **choice} for i in range(n)],
                "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
                "kv_transfer_params": None,
            }
        )


@pytest.fixture
async def prefills(store: Store) -> AsyncIterator[list[ChoicesPrefill]]:
    started: list[ChoicesPrefill] = []
    for _ in range(3):
        worker = ChoicesPrefill(component="prefill", role=WorkerRole.PREFILL)
        started.append(worker)
        await worker.start()
        await worker.register(store)
    yield started
    for worker in started:
        await worker.stop()
        if worker.lease is not None:
            with contextlib.suppress(Exception):
                await worker.lease.revoke()


def _inhibited_prefills(frontend: Frontend) -> int:
    model = frontend.registry.models["mock-llm"]
    assert model.stages is not None
    return sum(u.inhibited for ws in model.stages.prefill.routable_sets for u in ws.routable)


async def test_a_prefill_answer_too_long_for_what_the_request_asked_inhibits_no_prefill(
    prefills: list[ChoicesPrefill], start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """A chat asking for 20,000 choices makes each prefill answer ~2 MB, over
    `MAX_PREFILL_ANSWER`: the request fails (a 502), and no prefill instance is inhibited
    (each that it reached was: three of them out of routing for 5 s per such request, the
    whole fleet's prefill load piled on the rest)."""
    await start_worker(component="decode", role=WorkerRole.DECODE)
    frontend = await start_frontend()

    def served() -> bool:
        model = frontend.registry.models.get("mock-llm")
        return (
            model is not None
            and model.stages is not None
            and model.stages.prefill.live_instances == len(prefills)
        )

    await wait_for(served, timeout=20, message="three prefills and a decode")
    url = f"{frontend.url}/v1/chat/completions"
    chat = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
    assert MAX_PREFILL_ANSWER < 100 * 20_000  # (choices of ~100 bytes)
    async with aiohttp.ClientSession() as session, asyncio.timeout(20):
        async with session.post(url, json={**chat, "n": 20_000}) as response:
            assert response.status == 502, await response.text()
        assert _inhibited_prefills(frontend) == 0
        async with session.post(url, json=chat) as response:
            assert response.status == 200, await response.text()


class RefusesFirstHandle(FakeWorker):
    """A decode that cannot fetch the blocks of a request's first handle (its prefill died
    before the fetch), answering vLLM's 400 naming `kv_transfer_params`; it serves the next."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(component="decode", role=WorkerRole.DECODE)
        self.refused: set[str] = set()

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        user = json.loads(await request.read()).get("user", "")
        if user not in self.refused:
            self.refused.add(user)
            self.requests += 1
            error = {"message": "no such blocks", "param": "kv_transfer_params"}
            return web.json_response({"error": error}, status=400)
        return await super()._generate(request, kind)


async def test_a_decode_that_refused_a_dead_prefills_handle_takes_the_next_when_no_other_is_left(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """A prefill and a decode die together: a request prefilled by the dead prefill is refused
    by the live decode (it cannot fetch the blocks), prefilled again by a live prefill, and
    its decode then met the dead decode (still in discovery until its lease ends). The live
    decode, left out for refusing a handle that was never its fault, was not tried again:
    the request failed (502) with a live prefill and decode serving. It is now taken when no
    other decode is left."""
    await start_worker(component="prefill", role=WorkerRole.PREFILL)
    live = RefusesFirstHandle()
    dead = FakeWorker(component="decode", role=WorkerRole.DECODE)
    try:
        for worker in (live, dead):
            await worker.start()
            await worker.register(store)
        await dead.stop()  # (its connections refused; its lease and registration still held)
        frontend = await start_frontend()

        def served() -> bool:
            model = frontend.registry.models.get("mock-llm")
            return (
                model is not None
                and model.stages is not None
                and (model.stages.decode.live_instances == 2)
            )

        await wait_for(served, timeout=20, message="a prefill and two decodes")
        url = f"{frontend.url}/v1/chat/completions"
        chat = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
        statuses = []
        async with aiohttp.ClientSession() as session, asyncio.timeout(20):
            for user in ("a", "b", "c", "d"):
                async with session.post(url, json={**chat, "user": user}) as response:
                    statuses.append(response.status)
        assert statuses == [200] * 4
    finally:
        for worker in (live, dead):
            await worker.stop()
            if worker.lease is not None:
                with contextlib.suppress(Exception):
                    await worker.lease.revoke()
