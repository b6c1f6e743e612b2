"""The request body bytes a frontend holds across all its connections are bounded
(`--max-body-memory`): bodies being received and those of pipelined requests waiting their
turn. The request that crosses the bound is refused 503; what was held is given back when a
request is handed on, refused, or its connection closes, so the count returns to zero."""

from __future__ import annotations

import asyncio
import threading

from shoal.frontend.proxy import fields as fields_module
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import raw_exchange, serving
from tests.helpers import wait_for

KIB = 1024


def post(body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


def chat(size: int) -> bytes:
    """A chat request body of about `size` bytes."""
    pad = b"x" * max(0, size - 80)
    return b'{"model":"mock-llm","messages":[{"role":"user","content":"%s"}]}' % pad


async def test_bodies_held_across_connections_are_bounded_and_given_back(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """Each connection was bounded (`--max-body`), all of them together not at all: 40
    connections sending 15 MiB bodies slowly held 600 MB of the frontend, no key or model
    needed. Now the request crossing the server's budget is refused 503 `server_busy`."""
    await start_worker()
    frontend = await start_frontend(max_body=1024 * KIB, max_body_memory=1024 * KIB)
    await wait_for(lambda: serving(frontend), message="served")
    bodies = frontend.server.bodies
    # A client sends most of a large body, and waits.
    slow_reader, slow = await asyncio.open_connection("127.0.0.1", frontend.port)
    slow.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ncontent-length: %d\r\n\r\n"
               % (1000 * KIB) + b"x" * (800 * KIB))  # fmt: skip
    await wait_for(lambda: bodies.held >= 800 * KIB, message="the slow body held")
    # Another's request would cross the budget: refused, saying why.
    refused = await asyncio.wait_for(raw_exchange(frontend.port, post(chat(400 * KIB))), 10)
    assert refused.startswith(b"HTTP/1.1 503 "), refused[:200]
    assert b"server_busy" in refused and b"request bodies" in refused
    # A small one fits.
    small = await raw_exchange(frontend.port, post(chat(1 * KIB)))
    assert small.startswith(b"HTTP/1.1 200 "), small[:200]
    slow.close()
    await wait_for(lambda: bodies.held == 0, message="the slow body given back")
    # Free again: the large request is served.
    served = await asyncio.wait_for(raw_exchange(frontend.port, post(chat(400 * KIB))), 10)
    assert served.startswith(b"HTTP/1.1 200 "), served[:200]
    assert bodies.held == 0
    del slow_reader


async def test_bodies_of_pipelined_requests_waiting_are_counted_until_answered(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """Pipelined behind a request a slow worker holds, up to 16 requests wait with their whole
    bodies: counted until each is handed on, and given back when the connection closes."""
    worker = await start_worker()
    frontend = await start_frontend(max_body=1024 * KIB, max_body_memory=4096 * KIB)
    await wait_for(lambda: serving(frontend), message="served")
    bodies = frontend.server.bodies
    worker.answering.clear()  # (it reads requests, and answers none)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    writer.write(post(chat(1 * KIB)) + post(chat(300 * KIB)) * 3)
    await wait_for(lambda: worker.requests == 1, message="the first request at the worker")
    waiting = 3 * len(chat(300 * KIB))
    await wait_for(lambda: bodies.held == waiting, message="three bodies waiting")
    writer.close()
    await wait_for(lambda: bodies.held == 0, message="given back as the connection closed")
    worker.answering.set()
    del reader


async def test_large_bodies_waiting_for_their_decode_stay_counted(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """A large body (`LARGE_BODY`) is decoded in the decoder process, one at a time: once
    handed on it was given back to the budget, yet it waited, whole, for the decoder's one
    thread. Bodies sent faster than they are decoded queued there without bound (with the
    decoder busy: two 600 KB bodies waiting, 0 bytes counted). They are counted until
    decoded now: the request crossing the budget is 503."""
    await start_worker()
    body = chat(600 * KIB)
    frontend = await start_frontend(max_body=1024 * KIB, max_body_memory=2 * len(body) + 1)
    await wait_for(lambda: serving(frontend), message="served")
    bodies = frontend.server.bodies
    started, release = threading.Event(), threading.Event()
    fields_module._DECODER.submit(lambda: (started.set(), release.wait(30)))
    try:
        await asyncio.to_thread(started.wait, 10)  # the decoder's thread is busy
        waiting = [asyncio.create_task(raw_exchange(frontend.port, post(body))) for _ in range(2)]
        await wait_for(lambda: bodies.held == 2 * len(body), message="two bodies counted")
        refused = await asyncio.wait_for(raw_exchange(frontend.port, post(body)), 10)
        assert refused.startswith(b"HTTP/1.1 503 ") and b"server_busy" in refused, refused[:200]
    finally:
        release.set()
    for answer in await asyncio.gather(*waiting):
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    await wait_for(lambda: bodies.held == 0, message="given back once decoded")
