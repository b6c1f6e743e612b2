"""The gateway's own limit of open files is never an instance's fault: a connect that fails
for want of a file descriptor in the gateway (EMFILE) inhibits no instance and is answered
503 saying so, and the instances serve again as soon as descriptors are free."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from shoal import open_files
from shoal.cards import WorkerRole
from shoal.frontend import Frontend
from shoal.frontend.http import upstream
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.raw_upstream import StartRaw, start_raw
from tests.frontend.support import raw_exchange, serving
from tests.frontend.test_disagg_faults import _two_stages
from tests.frontend.test_migration_last_resort import Gated
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture

BODY = b'{"model":"mock-llm","messages":[{"role":"user","content":"hi"}]}'
POST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


@contextlib.contextmanager
def no_free_descriptor() -> Iterator[None]:
    """This process can open no file while inside: its soft limit is its lowest free one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.open(os.devnull, os.O_RDONLY)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def read_response(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


@pytest.mark.parametrize("stages", [False, True], ids=["whole", "prefill and decode"])
async def test_a_connect_failing_for_the_gateways_own_file_limit_inhibits_no_instance(
    start_worker: StartWorker, start_frontend: StartFrontend, stages: bool
) -> None:
    """Out of descriptors, every connect failed as if refused: each instance was inhibited in
    turn (a refused connect costs no attempt, so all three) and the client got 502 blaming
    them, though not one had failed."""
    if stages:
        workers = [
            await start_worker(component="prefill", role=WorkerRole.PREFILL),
            await start_worker(component="prefill", role=WorkerRole.PREFILL),
            await start_worker(component="decode", role=WorkerRole.DECODE),
        ]
    else:
        workers = [await start_worker() for _ in range(3)]
    frontend = await start_frontend()
    if stages:
        await _two_stages(frontend)
    else:
        await wait_for(lambda: serving(frontend, "mock-llm", 3), message="three instances served")
    # (a client connection the gateway holds already: accepting it needs no descriptor then)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(b"GET /live HTTP/1.1\r\nhost: gateway\r\n\r\n")
        assert (await read_response(reader)).startswith(b"HTTP/1.1 200 ")
        with no_free_descriptor():
            writer.write(POST)
            answer = await asyncio.wait_for(read_response(reader), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert b"open files" in answer
    assert frontend.metrics.instances_inhibited._value.get() == 0
    assert sum(w.requests for w in workers) == 0
    stats = frontend.metrics.models["mock-llm"]
    await wait_for(lambda: stats.in_flight == 0, message="the request left the gauge")
    # Descriptors free again: the instances serve at once (none was inhibited).
    again = await raw_exchange(frontend.port, POST)
    assert again.startswith(b"HTTP/1.1 200 "), again


async def test_client_connections_are_held_within_the_limit_of_open_files(
    start_worker: StartWorker, start_frontend: StartFrontend, caplog: pytest.LogCaptureFixture
) -> None:
    """`--max-connections` (10,000) over what the process may open (a soft limit of 1,024, or a
    hard one of 4,096): past the limit, accepts failed and libuv closed each new connection at
    once, unanswered (a liveness probe saw a reset), and connects to instances failed. Now a
    frontend serves at most half the descriptors left beside `RESERVED`, and says so: the
    connection over it is answered 503 `too_many_connections`."""
    await start_worker()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1000, hard))
    try:
        frontend = await start_frontend()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    limit = (1000 - open_files.RESERVED) // 2
    assert frontend.server.max_connections == limit
    assert f"serving at most {limit} client connections, not 10000" in caplog.text
    await wait_for(lambda: serving(frontend), message="served")
    held = [await asyncio.open_connection("127.0.0.1", frontend.port) for _ in range(limit)]
    try:
        await wait_for(lambda: len(frontend.server.connections) == limit, message="all held")
        over = await raw_exchange(frontend.port, POST)
        assert over.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in over, over
    finally:
        for _, writer in held:
            writer.close()


async def test_a_stream_migrating_while_out_of_files_inhibits_no_other_instance(
    start_raw: StartRaw, start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's instance dies and the gateway, out of descriptors, can open no connection
    to continue it: each continuation's connect failed with EMFILE, and `Migration.resume`
    took it for that instance's failure, inhibiting it and trying the next (the three
    instances all inhibited, though only the first had failed). Now the stream ends with its
    error event naming the gateway's limit, and only the instance that died is inhibited."""
    script = Gated()
    for _ in range(3):
        await start_raw(script)
    frontend: Frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, "mock-llm", 3), message="model served")
    out_of_files = False
    real = upstream.open_within

    async def opening(*args: Any) -> Any:  # (the socket the connect would open: EMFILE)
        if out_of_files:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return await real(*args)

    monkeypatch.setattr(upstream, "open_within", opening)
    body = {
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "Tell me"}],
        "max_tokens": 10,
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 200
        await response.content.readuntil(b"upon")  # the stream runs on one instance
        out_of_files = True
        script.cut.set()
        received = await response.read()
    assert b"open files" in received, received
    assert frontend.metrics.instances_inhibited._value.get() == 1  # (the one that died)
    assert len(script.bodies) == 1
    model = frontend.registry.models["mock-llm"]
    await wait_for(
        lambda: all(not u.in_flight for ws in model.routable_sets for u in ws.routable),
        message="no request in flight",
    )
