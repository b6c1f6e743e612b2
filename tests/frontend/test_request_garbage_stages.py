"""A disaggregated request leaves nothing for the garbage collector, whichever way its
prefill fails: the same proof as test_request_garbage.py, through an in-process frontend over
real sockets (the prefill stage awaits its answer in a task). Only shoal's objects are
counted: the event loop's own (a closed connection's selector transport) are not the
request path's.

Log records name the failures they report, and pytest keeps the records a test logs: the
gateway's are not made here (`quiet`), or they would keep alive what they name."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from shoal.cards import WorkerRole
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import Behaviour, RawUpstream, completion, json_answer
from tests.frontend.support import shoal_cycles
from tests.helpers import wait_for

REQUESTS = 10
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
HANDLE = b'{"id":"p","choices":[],"kv_transfer_params":{"remote_block_ids":[1]}}'


@pytest.fixture
def quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="shoal")


StartStage = Callable[[Behaviour, WorkerRole], Awaitable[RawUpstream]]


@pytest.fixture
async def start_stage(store: Store) -> AsyncIterator[StartStage]:
    started: list[RawUpstream] = []

    async def start(behaviour: Behaviour, role: WorkerRole) -> RawUpstream:
        stage = RawUpstream(behaviour)
        stage.role, stage.component = role, role.value
        started.append(await stage.start())
        await stage.register(store)
        return stage

    yield start
    for stage in started:
        await stage.stop()


async def two_stages(
    start_frontend: StartFrontend, start_stage: StartStage, prefill: Behaviour, **settings: object
) -> Frontend:
    async def decode(request: bytes, _: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(completion())

    await start_stage(prefill, WorkerRole.PREFILL)
    await start_stage(decode, WorkerRole.DECODE)
    frontend = await start_frontend(reconcile_interval=3600, **settings)

    def served() -> bool:
        model = frontend.registry.models.get("mock-llm")
        return model is not None and model.stages is not None and model.stages.decode.serving

    await wait_for(served, timeout=20, message="served in two stages")
    return frontend


async def serve(frontend: Frontend, n: int, status: int) -> None:
    """`n` chat requests one after the other on one keep-alive connection."""
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            async with session.post(f"{frontend.url}/v1/chat/completions", json=CHAT) as resp:
                await resp.read()
                assert resp.status == status, await resp.text()


async def cut(_: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{")
    await writer.drain()
    writer.transport.abort()


async def silent(_: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await reader.read(65536):  # (until the gateway gives up and drops the connection)
        pass


PREFILL_FAILURES: dict[str, tuple[Behaviour, int]] = {
    "error": (json_answer(b"503 Service Unavailable", b'{"error":{"message":"busy"}}'), 502),
    "cut": (cut, 502),
    "silent": (silent, 504),
    "unreadable": (json_answer(b"200 OK", b"not json"), 502),
}


@pytest.mark.parametrize("failure", list(PREFILL_FAILURES))
async def test_a_failed_prefill_leaves_no_cycle(
    failure: str, start_frontend: StartFrontend, start_stage: StartStage, quiet: None
) -> None:
    """The prefill's failure was kept for the answer in a local of the task whose frame its
    traceback holds: the failure, its traceback and the request waited for the collector."""
    behaviour, status = PREFILL_FAILURES[failure]
    timeout = 0.05 if failure == "silent" else 60.0  # (a loaded machine is no silent instance)
    frontend = await two_stages(start_frontend, start_stage, behaviour, first_byte_timeout=timeout)
    await serve(frontend, 2, status)  # (what the first requests make once: the pool, ...)
    with shoal_cycles() as left:
        await serve(frontend, REQUESTS, status)
    assert not left, f"{REQUESTS} requests whose prefill failed ({failure}) left {left}"


async def test_a_prefill_connection_found_closed_leaves_no_cycle(
    start_frontend: StartFrontend, start_stage: StartStage, quiet: None
) -> None:
    """A pooled connection the prefill instance had closed fails unanswered, and the prefill
    is sent again on a new one: the failure it read was the answer's future's exception,
    whose traceback holds the frame that reads the future."""
    answered: set[asyncio.StreamWriter] = set()

    async def once(request: bytes, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if w in answered:  # (the second request on a connection: it was closed meanwhile)
            w.transport.abort()
            return
        answered.add(w)
        await json_answer(b"200 OK", HANDLE)(request, reader, w)

    frontend = await two_stages(start_frontend, start_stage, once)
    await serve(frontend, 2, 200)
    with shoal_cycles() as left:
        await serve(frontend, REQUESTS, 200)
    assert not left, f"{REQUESTS} prefills sent again on a new connection left {left}"
    assert len(answered) >= REQUESTS  # (each on a connection of its own: the path was taken)
