"""Two prefill/decode pairs of one model (a rolling upgrade): one pair serves, and a request
never mixes them: a decode only takes a handle its own pair's prefill made."""

from __future__ import annotations

import asyncio

import aiohttp

from shoal.cards import WorkerRole
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import Behaviour, RawUpstream, completion, json_answer
from tests.frontend.test_disagg_faults import _two_stages
from tests.helpers import wait_for

CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}


def _handle(block: int) -> bytes:
    return b'{"id":"p","choices":[],"kv_transfer_params":{"remote_block_ids":[%d]}}' % block


async def _stage(store: Store, behaviour: Behaviour, role: WorkerRole, version: str) -> RawUpstream:
    upstream = RawUpstream(behaviour)
    upstream.role, upstream.component = role, f"{role.value}-v{version}"
    upstream.version = version  # (another checksum: another pair)
    upstream.metadata = b'{"model": "mock-llm", "version": "%s"}' % version.encode()
    await upstream.start()
    await upstream.register(store)
    return upstream


async def answers(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(completion())


def _pair(frontend: Frontend) -> str:
    stages = frontend.registry.models["mock-llm"].stages
    return stages.pairsum if stages is not None else ""


async def test_a_request_prefilled_by_a_pair_that_stops_serving_is_prefilled_again_in_the_new(
    store: Store, start_frontend: StartFrontend
) -> None:
    release = asyncio.Event()

    async def slow_prefill(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await release.wait()  # (a long prompt)
        await json_answer(b"200 OK", _handle(1))(request, reader, writer)

    started = [
        await _stage(store, slow_prefill, WorkerRole.PREFILL, "1"),
        await _stage(store, answers, WorkerRole.DECODE, "1"),
    ]
    try:
        frontend = await start_frontend()
        await _two_stages(frontend)
        old = _pair(frontend)
        async with aiohttp.ClientSession() as session, asyncio.timeout(20):
            answer = asyncio.ensure_future(
                session.post(f"{frontend.url}/v1/chat/completions", json=CHAT)
            )
            await wait_for(lambda: started[0].requests == 1, message="the first prefill began")
            # The upgrade: a pair of another checksum with more decodes takes over.
            new_prefill = await _stage(
                store, json_answer(b"200 OK", _handle(2)), WorkerRole.PREFILL, "2"
            )
            new_decodes = [await _stage(store, answers, WorkerRole.DECODE, "2") for _ in range(2)]
            started += [new_prefill, *new_decodes]
            await wait_for(lambda: _pair(frontend) not in ("", old), message="the new pair serves")
            release.set()
            response = await answer
            assert response.status == 200, await response.text()
        handed = [r for d in new_decodes for r in d.raw_requests]
        assert len(handed) == 1  # the decode went to the pair serving, with its own handle
        assert b'"remote_block_ids":[2]' in handed[0] and b"[1]" not in handed[0]
        assert new_prefill.requests == 1 and started[1].requests == 0
    finally:
        for upstream in started:
            await upstream.stop()
