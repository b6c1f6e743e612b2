"""The raw HTTP/1.1 server: keep-alive, pipelining, request body framings, limits."""

from __future__ import annotations

import asyncio
import json

from shoal.frontend import Frontend
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import FakeWorker, count_responses, raw_exchange, serving
from tests.helpers import wait_for

BODY = b'{"model":"mock-llm","messages":[{"role":"user","content":"hi"}]}'


def post(body: bytes = BODY, *extra: str) -> bytes:
    head = [
        "POST /v1/chat/completions HTTP/1.1",
        "Host: test",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def served(
    start_worker: StartWorker, start_frontend: StartFrontend, **settings: object
) -> tuple[FakeWorker, Frontend]:
    worker = await start_worker()
    frontend = await start_frontend(**settings)
    await wait_for(lambda: serving(frontend))
    return worker, frontend


async def test_keep_alive_carries_several_requests(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker, frontend = await served(start_worker, start_frontend)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        received = b""
        for expected in (1, 2, 3):
            writer.write(post())
            while count_responses(received) < expected:
                received += await reader.read(65536)
    finally:
        writer.close()
    assert received.count(b"HTTP/1.1 200 OK") == 3
    assert worker.requests == 3


async def test_pipelined_requests_are_answered_in_order(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker, frontend = await served(start_worker, start_frontend)
    bodies = [json.dumps({"model": "mock-llm", "messages": [], "n": i}).encode() for i in range(5)]
    data = b"".join(post(b) for b in bodies)
    received = await raw_exchange(frontend.port, data, responses=5)
    assert received.count(b"HTTP/1.1 200 OK") == 5
    assert worker.bodies == bodies  # one at a time, in order


async def test_chunked_request_body_is_forwarded_whole(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker, frontend = await served(start_worker, start_frontend)
    half = len(BODY) // 2
    chunks = [BODY[:half], BODY[half:]]
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
        + b"0\r\n\r\n"
    )
    received = await raw_exchange(frontend.port, data)
    assert received.startswith(b"HTTP/1.1 200 OK")
    assert worker.bodies == [BODY]


async def test_expect_100_continue_is_answered(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    _worker, frontend = await served(start_worker, start_frontend)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        head, _, body = post(BODY, "Expect: 100-continue").partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")
        interim = await reader.readuntil(b"\r\n\r\n")
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        received = b""
        while count_responses(received) < 1:
            received += await reader.read(65536)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 200 OK")


async def test_declared_body_over_the_limit_is_refused_before_it_is_read(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker, frontend = await served(start_worker, start_frontend, max_body=100)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n"
        )
        response = await reader.read(65536)  # answered without sending the body
    finally:
        writer.close()
    assert response.startswith(b"HTTP/1.1 413 ")
    assert b"connection: close" in response
    assert worker.requests == 0


async def test_chunked_body_over_the_limit_is_413(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker, frontend = await served(start_worker, start_frontend, max_body=100)
    chunk = b"x" * 80
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2
        + b"0\r\n\r\n"
    )
    received = await raw_exchange(frontend.port, data)
    assert received.startswith(b"HTTP/1.1 413 ")
    assert worker.requests == 0


async def test_malformed_request_is_400_and_closes(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend()
    received = await raw_exchange(frontend.port, b"NOT HTTP AT ALL\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 400 ")
    assert b"Malformed HTTP request" in received


async def test_http10_client_gets_a_streamed_response_ended_by_close(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    _worker, frontend = await served(start_worker, start_frontend)
    body = b'{"model":"mock-llm","messages":[],"stream":true}'
    data = b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    received = await raw_exchange(frontend.port, data, responses=99)  # read until closed
    head, _, payload = received.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert payload.rstrip().endswith(b"data: [DONE]")


async def test_idle_keep_alive_connections_are_closed_after_the_timeout(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(keepalive_timeout=0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    writer.write(b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n")
    received = b""
    async with asyncio.timeout(5):
        while chunk := await reader.read(65536):
            received += chunk
    writer.close()
    assert received.startswith(b"HTTP/1.1 200 OK")
