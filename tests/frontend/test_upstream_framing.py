"""What a response's chunk framing may cost the gateway: chunk lines, their extensions and the
trailer section are bounded between two body bytes, as a response head is (`MAX_RESPONSE_HEAD`),
so an upstream cannot make the gateway read framing without end. Raw sockets on both sides."""

from __future__ import annotations

import asyncio

import pytest

from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import StartRaw, endless, start_raw
from tests.frontend.support import raw_exchange, serving
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture

BODY = b'{"model":"mock-llm","messages":[{"role":"user","content":"hi"}]}'
POST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("start", "piece"),
    [
        (HEAD + b"2\r\n{}\r\n0\r\nx-trailer: ", b"t" * 1024),  # (one line: the parser holds it)
        (HEAD + b"2\r\n{}\r\n2;ext=", b"e" * 1024),
        (HEAD + b"2\r\n{}\r\n", b"0" * 1024),  # (a chunk size of endless leading zeros)
    ],
    ids=["a trailer line", "a chunk extension", "a chunk size line"],
)
async def test_chunk_framing_without_end_fails_the_response_within_a_bound(
    start_raw: StartRaw, start_frontend: StartFrontend, start: bytes, piece: bytes
) -> None:
    """A worker (or a provider, on the internet) sending a trailer line without end had it
    read into memory, copied again at every packet (a 10 MB line held the event loop 380 ms),
    and one sending a chunk extension without end kept the request in flight for as long as it
    liked, the idle timeout never firing: bytes kept coming. Now framing between two body bytes
    is bounded as a head is: the response fails (a 502 naming the bound while the client has
    no byte of it, else its connection closes, the answer cut), the worker's connection is
    dropped, and the request leaves the in-flight gauge."""
    sent: list[int] = []

    await start_raw(endless(start, piece, sent))
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, "mock-llm"), message="model served")
    received = await asyncio.wait_for(raw_exchange(frontend.port, POST), 10)
    if received.startswith(b"HTTP/1.1 502 "):  # (failed before a byte went to the client)
        assert b"chunk framing over 65536 bytes" in received
    else:  # (the head went with the first chunk: the answer is cut, never ended cleanly)
        assert received.startswith(b"HTTP/1.1 200 OK\r\n")
        assert not received.endswith(b"0\r\n\r\n")
    await wait_for(lambda: sent, message="the upstream connection closed")
    # Unbounded, the whole 256 MiB went (what the kernel's loopback buffers absorb aside).
    assert sent[0] < 64 << 20
    stats = frontend.metrics.models["mock-llm"]
    await wait_for(lambda: stats.in_flight == 0, message="the request left the gauge")


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
async def test_a_bodiless_status_declared_chunked_gets_no_chunks_on_the_client_connection(
    start_raw: StartRaw, start_frontend: StartFrontend, status: bytes
) -> None:
    """A 204 or 304 has no body, whatever its head says (RFC 9112 §6.3); one saying
    `transfer-encoding: chunked` was relayed chunked, its empty last chunk (`0\\r\\n\\r\\n`)
    written after the head: the client read those bytes as the start of its next answer on
    the connection (a proxy in front pooling it: another user's answer), out of step."""

    async def bodiless(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.1 %s\r\ntransfer-encoding: chunked\r\n\r\n" % status)

    await start_raw(bodiless)
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, "mock-llm"), message="model served")
    live = b"GET /live HTTP/1.1\r\nhost: gateway\r\n\r\n"
    received = await raw_exchange(frontend.port, POST + live, responses=2)
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 " + status + b"\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n"), rest  # (the next answer, in step)
