"""A stage instance that answers garbage fails only its own request, which is answered (a
relayed refusal, or another instance), and every in-flight count returns to zero."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from shoal.cards import WorkerRole
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.raw_upstream import (
    Behaviour,
    RawUpstream,
    completion,
    json_answer,
    until_closed,
)
from tests.helpers import wait_for

DEEP = b"[" * 30_000 + b"]" * 30_000  # (within the 64 KiB a decode's 400 is read for)


async def _raw_stage(store: Store, behaviour: Behaviour, role: WorkerRole) -> RawUpstream:
    upstream = RawUpstream(behaviour)
    upstream.role, upstream.component = role, role.value
    await upstream.start()
    await upstream.register(store)
    return upstream


async def _two_stages(frontend: Frontend) -> None:
    def served() -> bool:
        model = frontend.registry.models.get("mock-llm")
        return model is not None and model.stages is not None

    await wait_for(served, timeout=20, message="served in two stages")


def _in_flight(frontend: Frontend) -> list[int]:
    model = frontend.registry.models["mock-llm"]
    assert model.stages is not None
    sets = model.stages.prefill.routable_sets + model.stages.decode.routable_sets
    return [u.in_flight for ws in sets for u in ws.routable]


async def test_a_decodes_400_nested_too_deep_to_read_is_relayed_not_left_hanging(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    refuse = json_answer(
        b"400 Bad Request",
        b'{"error":{"message":"no","param":"kv_transfer_params","x":' + DEEP + b"}}",
    )

    await start_worker(component="prefill", role=WorkerRole.PREFILL)
    decode = await _raw_stage(store, refuse, WorkerRole.DECODE)
    try:
        frontend = await start_frontend()
        await _two_stages(frontend)
        body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
        async with (
            aiohttp.ClientSession() as session,
            asyncio.timeout(10),
            session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
        ):
            assert response.status == 400
            assert (await response.read()).startswith(b'{"error":{"message":"no"')
        await wait_for(lambda: _in_flight(frontend) == [0, 0], message="in flight back to 0")
    finally:
        await decode.stop()


async def test_a_prefills_4xx_nested_too_deep_to_read_is_relayed_with_its_status(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    refuse = json_answer(b"422 Unprocessable", b'{"error":{"message":"no","x":' + DEEP + b"}}")

    prefill = await _raw_stage(store, refuse, WorkerRole.PREFILL)
    await start_worker(component="decode", role=WorkerRole.DECODE)
    try:
        frontend = await start_frontend()
        await _two_stages(frontend)
        body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
        async with (
            aiohttp.ClientSession() as session,
            asyncio.timeout(10),
            session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
        ):
            assert response.status == 422, await response.text()
            error = (await response.json())["error"]
        assert "422" in error["message"]
        assert _in_flight(frontend) == [0, 0]
    finally:
        await prefill.stop()


async def test_a_decode_that_refuses_every_handle_is_not_picked_again_while_another_can_serve(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """A decode that answers every handle "400 kv_transfer_params" (broken, not the prefill's
    fault) is idle, so least-loaded would pick it at every attempt while the healthy decode
    is busy: after its refusal, the new prefill's decode goes to another decode instance."""

    refuse = json_answer(
        b"400 Bad Request", b'{"error":{"message":"no such blocks","param":"kv_transfer_params"}}'
    )

    await start_worker(component="prefill", role=WorkerRole.PREFILL)
    good = await start_worker(component="decode", role=WorkerRole.DECODE)
    good.stream_delay = 0.05
    bad = await _raw_stage(store, refuse, WorkerRole.DECODE)
    try:
        frontend = await start_frontend()

        def both_decodes() -> bool:
            model = frontend.registry.models.get("mock-llm")
            return (
                model is not None
                and model.stages is not None
                and model.stages.decode.live_instances == 2
            )

        await wait_for(both_decodes, timeout=20, message="two decodes")
        url = f"{frontend.url}/v1/chat/completions"
        body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session, asyncio.timeout(20):
            good.stream_chunks = 100  # a long stream keeps the healthy decode busy
            busy = asyncio.create_task(session.post(url, json={**body, "stream": True}))
            await wait_for(lambda: good.in_flight == 1, message="the healthy decode busy")
            good.stream_chunks = 3
            async with session.post(url, json=body) as response:
                assert response.status == 200, await response.text()
            busy.cancel()
    finally:
        await bad.stop()


@pytest.mark.parametrize(
    "sent",
    [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{",
        b"HTTP/1.1 200 OK\r\ncontent-type: appl",  # (half a head: its first byte counts)
    ],
    ids=["a head", "half a head"],
)
async def test_a_prefill_that_stalls_after_its_head_is_bounded_without_a_first_byte_timeout(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend, sent: bytes
) -> None:
    """With `--first-byte-timeout 0` a prefill was bounded by nothing: one that sent its head
    (or half of it) and then nothing held the request (and the instance's in-flight count)
    for ever. The idle timeout bounds a prefill's answer from its first byte."""

    async def head_then_silence(
        _: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(sent)
        await writer.drain()
        await reader.read()  # (until the gateway gives up and closes)

    prefill = await _raw_stage(store, head_then_silence, WorkerRole.PREFILL)
    await start_worker(component="decode", role=WorkerRole.DECODE)
    try:
        frontend = await start_frontend(first_byte_timeout=0.0, upstream_idle_timeout=0.5)
        await _two_stages(frontend)
        body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
        async with (
            aiohttp.ClientSession() as session,
            asyncio.timeout(10),
            session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
        ):
            assert response.status == 504, await response.text()
            error = (await response.json())["error"]
        assert error["code"] == "upstream_timeout"
        assert "stalled for 0.5s" in error["message"]
        await wait_for(lambda: _in_flight(frontend) == [0, 0], message="in flight back to 0")
    finally:
        await prefill.stop()


async def test_a_prefill_timed_out_on_a_pooled_connection_is_not_sent_again_as_if_stale(
    store: Store, start_frontend: StartFrontend
) -> None:
    """A pooled connection that fails before its head is taken for one the instance had
    closed, and the request is sent again on a new one. A timeout is no such failure: the
    instance got the prefill and sat on it. Re-sending it doubled the wait and the prefill."""
    handle = b'{"id":"p","choices":[],"kv_transfer_params":{"remote_block_ids":[1]}}'
    answered: list[int] = []

    async def answers_once_then_sits(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if not answered:
            answered.append(1)
            await json_answer(b"200 OK", handle)(request, reader, writer)
            return
        await until_closed(reader)

    async def answers(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(completion())

    prefill = await _raw_stage(store, answers_once_then_sits, WorkerRole.PREFILL)
    decode = await _raw_stage(store, answers, WorkerRole.DECODE)
    try:
        frontend = await start_frontend(first_byte_timeout=1.0)
        await _two_stages(frontend)
        body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
        url = f"{frontend.url}/v1/chat/completions"
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session, asyncio.timeout(10):
            async with session.post(url, json=body) as response:
                assert response.status == 200, await response.text()
            began = loop.time()
            async with session.post(url, json=body) as response:
                assert response.status == 504, await response.text()
                error = (await response.json())["error"]
            waited = loop.time() - began
        assert error["code"] == "upstream_timeout"
        assert len(prefill.raw_requests) == 2  # (three when the timeout was sent again)
        assert waited < 1.8  # one first-byte timeout (and a sweep), not two
        await wait_for(lambda: _in_flight(frontend) == [0, 0], message="in flight back to 0")
    finally:
        await prefill.stop()
        await decode.stop()
