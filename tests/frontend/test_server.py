"""The raw HTTP/1.1 server: keep-alive, pipelining, request body framings, limits."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

from shoal.frontend import Frontend
from shoal.frontend.http.server import FEED_SLICE, LINGER_BYTES, MAX_PIPELINED
from tests.frontend.conftest import StartFrontend, StartWorker, openai_client
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


async def read_until_closed(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (fails on timeout)."""
    received = b""
    async with asyncio.timeout(timeout):
        while chunk := await reader.read(65536):
            received += chunk
    return received


async def test_pipelined_flood_from_a_client_that_never_reads_stays_bounded(
    start_frontend: StartFrontend,
) -> None:
    """2,000 pipelined `/metrics` in one send from a client that does not read: the server
    stops producing once the client's send buffer is full (bounded memory), other clients
    are answered at once, and every flooded request is answered once the client reads."""
    frontend = await start_frontend()
    assert frontend.server is not None
    flood = 2000
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n" * flood)
        await writer.drain()
        # The server stops reading and answering the flood: its send buffer stops growing.
        await wait_for(lambda: any(c.writing_paused for c in frontend.server.connections))
        started = time.perf_counter()
        other = await raw_exchange(frontend.port, b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n")
        latency = time.perf_counter() - started
        assert other.startswith(b"HTTP/1.1 200 OK")
        assert latency < 1.0, f"/live took {latency:.2f}s beside the flood"
        (conn,) = [c for c in frontend.server.connections if c.writing_paused]
        assert conn.transport is not None
        assert conn.transport.get_write_buffer_size() < 1024 * 1024
        assert len(conn.pending) <= MAX_PIPELINED + FEED_SLICE // 18  # 18: the smallest request
        answered = await count_status_lines(reader, flood)
    finally:
        writer.close()
    assert answered == flood


async def count_status_lines(reader: asyncio.StreamReader, expected: int) -> int:
    """How many `200 OK` status lines arrive, reading until `expected` did (linear time)."""
    marker = b"HTTP/1.1 200 OK\r\n"
    count, tail = 0, b""
    async with asyncio.timeout(30):
        while count < expected and (chunk := await reader.read(1 << 20)):
            data = tail + chunk
            count += data.count(marker)
            tail = data[-(len(marker) - 1) :]
    return count


async def test_pipelined_builtin_requests_are_answered_one_per_loop_turn(
    start_frontend: StartFrontend,
) -> None:
    """Pipelined built-in requests do not monopolise the loop: between two of them, other
    work runs (here: a callback scheduled when the packet arrived)."""
    frontend = await start_frontend()
    assert frontend.server is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n" * 50)
        received = b""
        turns = 0

        def tick() -> None:
            nonlocal turns
            turns += 1
            if turns < 1000:
                asyncio.get_running_loop().call_soon(tick)

        tick()
        async with asyncio.timeout(5):
            while count_responses(received) < 50:
                received += await reader.read(65536)
    finally:
        writer.close()
    assert received.count(b"HTTP/1.1 200 OK") == 50
    assert turns >= 25, f"only {turns} other loop turns while 50 requests were answered"


async def test_h2c_upgrade_is_ignored_and_answered_once(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """`curl --http2` on a cleartext URL: the Upgrade is ignored (RFC 9110 §7.8), the body
    reaches the worker whole, and the next request on the connection gets its own answer."""
    worker, frontend = await served(start_worker, start_frontend)
    upgrade = post(
        BODY,
        "Connection: Upgrade, HTTP2-Settings",
        "Upgrade: h2c",
        "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA",
    )
    live = b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n"
    received = await raw_exchange(frontend.port, upgrade + live, responses=2)
    assert count_responses(received) == 2
    first, _, rest = received.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 OK")
    assert worker.bodies == [BODY]
    assert b'{"status":"ok"}' in rest
    assert b" 400 " not in received


async def test_an_http10_request_asking_for_an_upgrade_stays_an_http10_request(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """The ignored `Upgrade` was read again as an HTTP/1.1 request: an HTTP/1.0 client (which
    cannot read chunks, RFC 9112 §6.1) got its stream chunked, and a connection it expected
    closed after the answer was kept alive until the keep-alive timeout."""
    _worker, frontend = await served(start_worker, start_frontend)
    body = b'{"model":"mock-llm","messages":[],"stream":true}'
    data = (
        b"POST /v1/chat/completions HTTP/1.0\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(data)
        received = await read_until_closed(reader, timeout=3.0)  # (kept alive, it waits 75 s)
    finally:
        writer.close()
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert b"transfer-encoding" not in head.lower()
    assert payload.rstrip().endswith(b"data: [DONE]")


async def test_a_request_target_in_absolute_form_is_served_as_its_path(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """RFC 9112 §3.2.2: a server MUST accept the absolute-form (`POST http://host/v1/...`),
    which a client sends through a proxy, or to a gateway it takes for one. It was answered
    404 `Unknown path 'http://host/v1/chat/completions'`."""
    worker, frontend = await served(start_worker, start_frontend)
    absolute = (
        b"POST http://gateway.example:8000/v1/chat/completions?x=1 HTTP/1.1\r\nHost: t\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
    )
    live = b"GET HTTP://gateway.example/live HTTP/1.1\r\nHost: t\r\n\r\n"
    received = await raw_exchange(frontend.port, absolute + live, responses=2)
    assert count_responses(received) == 2
    assert received.startswith(b"HTTP/1.1 200 OK") and worker.bodies == [BODY]
    assert received.endswith(b'{"status":"ok"}')


async def test_complete_request_before_garbage_is_answered_then_400_then_close(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker, frontend = await served(start_worker, start_frontend)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(post() + b"GARBAGE\r\n\r\n")
        received = await read_until_closed(reader)
    finally:
        writer.close()
    assert count_responses(received) == 2
    assert received.startswith(b"HTTP/1.1 200 OK")
    second = received[received.index(b"HTTP/1.1 400 ") :]
    assert b"Malformed HTTP request" in second
    assert b"connection: close" in second
    assert worker.requests == 1


async def test_http10_request_followed_by_a_stray_byte_is_answered(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker, frontend = await served(start_worker, start_frontend)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    head = b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    try:
        writer.write(head + BODY + b"X")
        received = await read_until_closed(reader)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 200 OK")
    assert count_responses(received) == 1
    assert worker.requests == 1


async def test_connection_close_request_is_answered_and_what_follows_dropped(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker, frontend = await served(start_worker, start_frontend)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(post(BODY, "Connection: close") + post())
        received = await read_until_closed(reader)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 200 OK")
    assert count_responses(received) == 1
    assert worker.requests == 1


async def test_chunked_upload_over_the_limit_is_refused_while_it_is_sent(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """The 413 arrives and the server closes while the client is still sending chunks:
    the upload is not read to its end."""
    worker, frontend = await served(start_worker, start_frontend, max_body=1000)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    chunk = b"%x\r\n%s\r\n" % (600, b"x" * 600)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        writer.write(chunk * 2)  # 1,200 bytes: over the limit, and the upload goes on
        received = await read_until_closed(reader)
        assert not writer.is_closing()  # the client never ended its upload
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 413 ")
    assert json.loads(received.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"
    assert worker.requests == 0


async def test_a_client_that_keeps_sending_after_the_413_is_cut_within_the_linger_budget(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """After a 413 the server drops at most its linger budget (here LINGER_BYTES) before it
    closes, so a client pushing on finds its writes refused (not swallowed for seconds)."""
    _worker, frontend = await served(start_worker, start_frontend, max_body=1000)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
    sent = 0
    loop = asyncio.get_running_loop()
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        writer.write(chunk)
        received = await reader.readuntil(b"request_too_large")  # the 413 is in
        answered = loop.time()
        refused_after = None
        async with asyncio.timeout(5):
            while refused_after is None:
                try:
                    writer.write(chunk)
                    await writer.drain()
                    sent += len(chunk)
                except (ConnectionResetError, BrokenPipeError):
                    refused_after = loop.time() - answered
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 413 ")
    assert refused_after < 1.0  # (lingering read and dropped for 2 s, 3 GB on loopback)
    assert sent < LINGER_BYTES + (16 << 20)  # (what the two kernels' buffers can hold)


async def test_transfer_coding_other_than_chunked_is_501(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker, frontend = await served(start_worker, start_frontend)
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    )
    received = await raw_exchange(frontend.port, data)
    assert received.startswith(b"HTTP/1.1 501 ")
    error = json.loads(received.partition(b"\r\n\r\n")[2])["error"]
    assert "gzip, chunked" in error["message"]
    assert worker.requests == 0


async def test_the_official_client_sending_a_body_over_the_limit_reads_its_413(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """httpx writes the whole body before it reads: the server lingers (writes the 413, shuts
    its side, drops what still arrives) so that the client reads the 413, not a reset."""
    worker, frontend = await served(start_worker, start_frontend, max_body=4 << 20)
    client = openai_client(frontend)
    for _ in range(3):
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(
                model="mock-llm",
                messages=[{"role": "user", "content": "x" * (7 << 20)}],
            )
        assert refused.value.status_code == 413
        assert str(4 << 20) in refused.value.message
    assert worker.requests == 0


def chunked_with_trailers(trailers: bytes, *extra: bytes) -> bytes:
    """`BODY` as one chunk, then the last chunk and `trailers` (header lines) and the end."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
    return (
        head + b"".join(line + b"\r\n" for line in extra) + b"\r\n"
        + b"%x\r\n%s\r\n0\r\n" % (len(BODY), BODY) + trailers + b"\r\n"
    )  # fmt: skip


async def test_trailer_fields_never_reach_the_worker_as_headers(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """httptools reports a chunked body's trailer fields as headers after the body: they
    were merged into the request's headers and forwarded as such (past every check of the
    head). They are dropped (RFC 9110 §6.5.1); the request is served as without them."""
    worker, frontend = await served(start_worker, start_frontend)
    trailers = b"x-injected-by-trailer: yes\r\nx-forwarded-for: 6.6.6.6\r\n"
    data = chunked_with_trailers(trailers) * 2  # (and the next request is read in step)
    received = await raw_exchange(frontend.port, data, responses=2)
    assert received.count(b"HTTP/1.1 200 OK") == 2
    assert worker.bodies == [BODY, BODY]
    for headers in worker.headers:
        assert "x-injected-by-trailer" not in headers
        assert "x-forwarded-for" not in headers


async def test_trailer_fields_over_the_header_limits_are_431_and_closed(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """The trailer section was bounded by nothing: 5,000 fields passed `max_headers`, and one
    without end (sent for ever) grew the gateway's memory without bound. Trailers are held to
    the head's limits: `max_headers` fields, `max_header_size` bytes."""
    worker, frontend = await served(
        start_worker, start_frontend, max_headers=10, max_header_size=4096
    )
    many = b"".join(b"x-t%d: v\r\n" % i for i in range(11))
    one_long = b"x-long: " + b"a" * 5000 + b"\r\n"
    for trailers, why in ((many, "more than 10 trailer fields"), (one_long, "over 4096 bytes")):
        received = await raw_exchange(frontend.port, chunked_with_trailers(trailers))
        assert received.startswith(b"HTTP/1.1 431 "), received[:200]
        assert b"connection: close" in received
        error = json.loads(received.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_header_fields_too_large"
        assert why in error["message"]
    # A trailer field without end is refused once over the bound, not buffered until it ends.
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(chunked_with_trailers(b"")[:-2] + b"x-endless: " + b"a" * (64 << 10))
        async with asyncio.timeout(5):
            received = await reader.read(65536)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 431 ")
    assert worker.requests == 0


async def test_an_http10_request_with_transfer_encoding_is_400_and_closed(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing (a front
    proxy speaking HTTP/1.0 frames it otherwise). It was decoded as chunked and the connection
    kept alive, the bytes after it answered as a request: it is refused, and what follows is
    never read."""
    worker, frontend = await served(start_worker, start_frontend)
    data = (
        b"POST /v1/chat/completions HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
        + b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"
    )  # fmt: skip
    received = await raw_exchange(frontend.port, data, responses=2)
    assert count_responses(received) == 1
    assert received.startswith(b"HTTP/1.1 400 ")
    assert b"connection: close" in received
    error = json.loads(received.partition(b"\r\n\r\n")[2])["error"]
    assert "Transfer-Encoding in an HTTP/1.0 request" in error["message"]
    assert worker.requests == 0
