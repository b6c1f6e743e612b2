"""Failures on pooled (warm) connections: a pooled connection that fails before any byte of
its answer may be one the instance had closed while idle, and the request is sent again on a
new connection, once and for free. Only that case is free: a request that kills the instance
it is sent to, or an answer cut short, costs an attempt, so one request cannot take the whole
fleet down one warm instance after another."""

from __future__ import annotations

import asyncio

import aiohttp

from shoal.cards import WorkerRole
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import (
    Behaviour,
    RawUpstream,
    StartRaw,
    completion,
    json_answer,
    start_raw,
)
from tests.frontend.support import serving
from tests.frontend.test_disagg_faults import _raw_stage, _two_stages
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture

BODY = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
POISON = {"model": "mock-llm", "messages": [{"role": "user", "content": "poison"}]}


async def _mortal(start_raw: StartRaw) -> RawUpstream:
    """An instance that answers, and dies of a request that says "poison": its connection
    drops and its port refuses from then on, as when the engine's process crashes."""
    box: list[RawUpstream] = []

    async def answer_or_die(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if b"poison" in request:
            box[0].stop_listening()
            writer.transport.abort()
            return
        writer.write(completion())

    box.append(await start_raw(answer_or_die))
    return box[0]


async def _warm(url: str, instances: list[RawUpstream]) -> None:
    """One answered request per instance (round-robin): each has a pooled connection."""
    async with aiohttp.ClientSession() as session:
        for _ in instances:
            async with session.post(url, json=BODY) as response:
                assert response.status == 200, await response.text()
    assert all(i.requests == 1 for i in instances), [i.requests for i in instances]


def _prefills(frontend: Frontend) -> int:
    model = frontend.registry.models["mock-llm"]
    assert model.stages is not None
    return sum(len(ws.routable) for ws in model.stages.prefill.routable_sets)


async def _status(url: str, body: dict[str, object]) -> int:
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(url, json=body) as response,
    ):
        await response.read()
        return response.status


def _poisoned(instances: list[RawUpstream]) -> int:
    return sum(1 for i in instances for r in i.raw_requests if b"poison" in r)


async def test_a_request_that_kills_warm_instances_spends_the_retry_budget(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    instances = [await _mortal(start_raw) for _ in range(4)]
    frontend = await start_frontend(retries=1)
    await wait_for(lambda: serving(frontend, "mock-llm", 4), message="4 instances")
    url = f"{frontend.url}/v1/chat/completions"
    await _warm(url, instances)
    assert await _status(url, POISON) == 502
    # The pooled connection lost before any answer is sent again once (it may have been
    # closed while idle); the new connection is refused: the instance died of the request.
    # Free, it took every instance of the fleet with it.
    assert _poisoned(instances) == 2, [len(i.raw_requests) for i in instances]


async def test_an_answer_cut_short_on_a_pooled_connection_is_not_sent_again_to_its_instance(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """Part of a head, then the connection drops: the instance had the request (it began to
    answer), so it is no stale connection; the request goes to another instance."""

    async def answer_or_cut(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if b"poison" in request:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: appl")
            await writer.drain()
            writer.transport.abort()
            return
        writer.write(completion())

    instances = [await start_raw(answer_or_cut) for _ in range(3)]
    frontend = await start_frontend(retries=1)
    await wait_for(lambda: serving(frontend, "mock-llm", 3), message="3 instances")
    url = f"{frontend.url}/v1/chat/completions"
    await _warm(url, instances)
    assert await _status(url, POISON) == 502
    counts = [sum(1 for r in i.raw_requests if b"poison" in r) for i in instances]
    assert sorted(counts) == [0, 1, 1], counts  # two attempts, two instances, once each


async def test_a_prefill_that_kills_warm_prefill_instances_spends_the_retry_budget(
    store: Store, start_frontend: StartFrontend
) -> None:
    handle = b'{"id":"p","choices":[],"kv_transfer_params":{"remote_block_ids":[1]}}'
    prefills: list[RawUpstream] = []

    def prefill_or_die(index: int) -> Behaviour:
        async def behaviour(
            request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            if b"poison" in request:
                prefills[index].stop_listening()
                writer.transport.abort()
                return
            await json_answer(b"200 OK", handle)(request, reader, writer)

        return behaviour

    async def answers(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(completion())

    for index in range(4):
        prefills.append(await _raw_stage(store, prefill_or_die(index), WorkerRole.PREFILL))
    decode = await _raw_stage(store, answers, WorkerRole.DECODE)
    try:
        frontend = await start_frontend(retries=1)
        await _two_stages(frontend)
        await wait_for(lambda: _prefills(frontend) == 4, message="4 prefill instances")
        url = f"{frontend.url}/v1/chat/completions"
        await _warm(url, prefills)
        assert await _status(url, POISON) == 502
        assert _poisoned(prefills) == 2, [len(p.raw_requests) for p in prefills]
    finally:
        for prefill in prefills:
            await prefill.stop()
        await decode.stop()
