"""What the gateway relays between client and upstream: interim responses, hop-by-hop
headers, its own headers, and credentials in instance URLs. Raw sockets on both sides, so
no HTTP library smooths over what was actually sent."""

from __future__ import annotations

import asyncio
import base64
import socket
import struct
from typing import Any

import aiohttp
import pytest

from shoal.frontend import Frontend
from shoal.frontend.http.upstream import Upstream
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import StartRaw, completion, endless, start_raw
from tests.frontend.support import count_responses, raw_exchange, serving
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture

BODY = b'{"model":"mock-llm","messages":[{"role":"user","content":"hi"}]}'


def post(*headers: bytes) -> bytes:
    extra = b"".join(h + b"\r\n" for h in headers)
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        + extra
        + b"content-length: %d\r\n\r\n" % len(BODY)
        + BODY
    )


def head_of(response: bytes) -> list[str]:
    return response.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower().split("\r\n")


async def started(start_frontend: StartFrontend, instances: int = 1) -> Frontend:
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, "mock-llm", instances), message="model served")
    return frontend


async def early_hints_then_ok(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n" + completion("final")
    )


async def test_interim_responses_are_skipped_and_the_final_one_relayed(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    upstream = await start_raw(early_hints_then_ok)
    frontend = await started(start_frontend)
    received = await raw_exchange(frontend.port, post() * 3, responses=3)
    assert count_responses(received) == 3
    assert received.count(b"HTTP/1.1 200 OK\r\n") == 3
    assert b"HTTP/1.1 10" not in received
    assert received.count(b'"content":"final"') == 3
    # The pooled connection stayed in step: all three went over the first one.
    assert upstream.requests == 3 and upstream.open_connections == 1


async def answer_with_hop_headers(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(
        completion(
            extra_headers=b"connection: x-up-hop\r\nx-up-hop: secret\r\nx-up-kept: yes\r\n"
            b"x-shoal-instance: forged\r\n"
        )
    )


async def test_headers_named_in_connection_are_not_forwarded_either_way(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    upstream = await start_raw(answer_with_hop_headers)
    frontend = await started(start_frontend)
    request = post(b"Connection: keep-alive, X-Hop", b"x-hop: secret", b"x-kept: yes")
    received = await raw_exchange(frontend.port, request)
    sent_upstream = head_of(upstream.raw_requests[-1])
    assert "x-kept: yes" in sent_upstream
    assert not [line for line in sent_upstream if line.startswith(("x-hop", "connection"))]
    relayed = head_of(received)
    assert relayed[0] == "http/1.1 200 ok"
    assert "x-up-kept: yes" in relayed
    assert not [line for line in relayed if line.startswith("x-up-hop")]
    # Only the gateway says which instance answered.
    assert [line for line in relayed if line.startswith("x-shoal-instance")] == [
        f"x-shoal-instance: {upstream.instance_id:x}"
    ]


async def answer_with_two_connection_lines(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(completion(extra_headers=b"connection: x-up-hop\r\nx-up-hop: secret\r\n"
                            b"connection: keep-alive\r\n"))  # fmt: skip


async def test_every_connection_line_names_headers_not_forwarded_either_way(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """RFC 9110 7.6.1: the `Connection` field is every line of it (the last alone was read)."""
    upstream = await start_raw(answer_with_two_connection_lines)
    frontend = await started(start_frontend)
    request = post(b"Connection: X-Hop", b"x-hop: secret", b"Connection: keep-alive")
    received = await raw_exchange(frontend.port, request)
    assert not [line for line in head_of(upstream.raw_requests[-1]) if line.startswith("x-hop")]
    assert head_of(received)[0] == "http/1.1 200 ok"
    assert not [line for line in head_of(received) if line.startswith("x-up-hop")]


async def test_instance_url_credentials_are_sent_as_basic_auth_never_in_host(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    upstream = await start_raw(answer_with_hop_headers, userinfo="worker:p%40ss@")
    frontend = await started(start_frontend)
    await raw_exchange(frontend.port, post(b"authorization: Bearer client-key"))
    sent_upstream = head_of(upstream.raw_requests[-1])
    assert f"host: 127.0.0.1:{upstream.raw_port}" in sent_upstream
    expected = "basic " + base64.b64encode(b"worker:p@ss").decode().lower()
    assert [line for line in sent_upstream if line.startswith("authorization")] == [
        f"authorization: {expected}"
    ]
    assert "p%40ss" not in repr(frontend.registry.models["mock-llm"].routable_sets[0].routable)


def test_an_upstream_without_credentials_sends_none() -> None:
    upstream = Upstream(1, "http://127.0.0.1:9/v1")
    assert upstream.host_header == b"127.0.0.1:9"
    assert upstream.authorization is None
    assert upstream.address == "http://127.0.0.1:9/v1"
    with_credentials = Upstream(2, "http://u:s3cret@127.0.0.1:9/v1")
    assert with_credentials.host_header == b"127.0.0.1:9"
    assert "s3cret" not in with_credentials.address and "s3cret" not in repr(with_credentials)


ENDLESS_PAD = b"x-pad: " + b"p" * 1000 + b"\r\n"


@pytest.mark.parametrize(
    ("start", "line"),
    [
        (b"HTTP/1.1 200 OK\r\n", ENDLESS_PAD),
        (b"", b"HTTP/1.1 103 Early Hints\r\n" + ENDLESS_PAD + b"\r\n"),
        (b"HTTP/1.1 200 OK\r\nx-big: ", b"v" * 1000),  # (one line: the parser holds it)
        (b"", b"HTTP/1.1 100 Continue\r\n\r\n"),  # (heads of no header line)
    ],
    ids=["header lines", "interim responses", "a header value", "bare interim heads"],
)
async def test_a_response_head_without_end_fails_the_attempt_within_a_bound(
    start_raw: StartRaw, start_frontend: StartFrontend, start: bytes, line: bytes
) -> None:
    """An upstream (a provider is on the internet) sending header lines without end was read
    into memory until the first-byte timeout (60 s: gigabytes on a fast link); interim
    responses without end likewise. Now a response head is bounded: 502 naming it."""
    sent: list[int] = []

    await start_raw(endless(start, line, sent))
    frontend = await started(start_frontend)
    received = await asyncio.wait_for(raw_exchange(frontend.port, post()), 10)
    assert received.startswith(b"HTTP/1.1 502 ")
    assert b"response head" in received
    await wait_for(lambda: sent, message="the upstream connection closed")
    # What the upstream managed to write before the frontend closed: the frontend's bounded
    # head, plus what the kernel's loopback buffers absorbed meanwhile (they autotune up to
    # tcp_rmem's maximum, 32 MiB on Debian); unbounded, the whole 256 MiB would go.
    assert sent[0] < 64 << 20


async def reset_mid_body(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    # No length, no chunks: the body ends when the connection does, but not by a reset.
    writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"id":"x",')
    await writer.drain()
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()  # (a crash: RST)


async def test_a_close_delimited_answer_cut_by_a_reset_is_a_failure_not_a_clean_end(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """A reset is no end: the client got half a JSON document with a clean chunked end, on a
    connection kept alive. Now it is the instance's failure: retried before the first byte
    reached the client (here: the head is relayed with the first body byte), else cut."""
    await start_raw(reset_mid_body)
    frontend = await started(start_frontend)
    received = await asyncio.wait_for(raw_exchange(frontend.port, post()), 10)
    assert received.startswith(b"HTTP/1.1 200 OK\r\n")  # (the client had the head)
    assert not received.endswith(b"\r\n0\r\n\r\n")  # (the chunked end of a complete answer)


async def test_bytes_after_a_response_in_its_packet_never_reach_the_next_request(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """A worker that sent more than its answer in the same packet (the start of another
    response): the connection was pooled while the parser went on into the extra bytes, and
    the next request on it got them as its answer (or hung)."""
    leak = b'{"secret-of-request-A":"' + b"x" * 40 + b'"}'
    answered: list[int] = []

    async def answer(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        answered.append(1)
        if len(answered) == 1:
            extra = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(leak) + 400, leak)
            writer.write(completion("A") + extra)
        else:
            writer.write(completion("B"))

    await start_raw(answer)
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend), message="served")
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        async with session.post(f"{frontend.url}/v1/chat/completions", json=body) as first:
            assert first.status == 200 and b'"content":"A"' in await first.read()
        for _ in range(2):
            async with session.post(f"{frontend.url}/v1/chat/completions", json=body) as later:
                received = await later.read()
                assert later.status == 200 and b'"content":"B"' in received, received
                assert b"secret-of-request-A" not in received
                assert later.headers.get("x-shoal-instance") is not None


async def answer_with_framing_listed_in_connection(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(completion(extra_headers=b"connection: keep-alive, content-length\r\n"))


async def test_framing_headers_named_in_connection_still_frame_the_message_either_way(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """An upstream whose `Connection:` listed `content-length` had it dropped as hop-by-hop,
    its body relayed unframed on a kept-alive client connection (the next answer read as
    part of it). Each hop frames its own message: the framing headers are never hop-by-hop."""
    upstream = await start_raw(answer_with_framing_listed_in_connection)
    frontend = await started(start_frontend)
    request = post(b"Connection: keep-alive, content-length, transfer-encoding")
    received = await raw_exchange(frontend.port, request * 2, responses=2)
    assert count_responses(received) == 2
    first = head_of(received)
    assert first[0] == "http/1.1 200 ok"
    assert [line for line in first if line.startswith("content-length: ")]
    assert received.count(b'"content":"hi"') == 2
    for sent in upstream.raw_requests:
        assert f"content-length: {len(BODY)}" in head_of(sent)
        assert sent.endswith(BODY)


async def switching_protocols(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
        b"\x81\x05hello"
    )


async def test_an_upstream_switching_protocols_fails_its_attempt_with_no_error_from_the_loop(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """A `101` (never asked for) made httptools raise `HttpParserUpgrade` out of the upstream
    connection's `data_received`: asyncio logged "Fatal error: protocol.data_received() call
    failed" with a traceback. It is that upstream's protocol error: the client gets 502."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        await start_raw(switching_protocols)
        frontend = await started(start_frontend)
        received = await asyncio.wait_for(raw_exchange(frontend.port, post()), 10)
        assert received.startswith(b"HTTP/1.1 502 ")
        assert b"switched protocols" in received
        assert errors == []
    finally:
        loop.set_exception_handler(None)


INJECTED = b'HTTP/1.1 200 OK\r\ncontent-length: 18\r\n\r\n{"injected":true}\n'
"""What a hostile upstream tries to slip into the client's connection as an answer of its own."""


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 099 Odd\r\ncontent-length: %d\r\n\r\n%s" % (len(INJECTED), INJECTED),
        b"HTTP/1.1 000 Odd\r\n\r\n" + INJECTED,  # (no framing: a body until the close)
        b"HTTP/1.1 150 Odd\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (len(INJECTED), INJECTED)
        + completion("final"),
        b"HTTP/1.1 199 Odd\r\ncontent-length: %d\r\n\r\n%s" % (len(INJECTED), INJECTED)
        + completion("final"),
    ],
    ids=["status under 100", "status 000 until the close", "1xx chunked", "1xx sized"],
)
async def test_a_status_under_100_or_an_interim_response_with_a_body_never_reaches_the_client(
    start_raw: StartRaw, start_frontend: StartFrontend, answer: bytes
) -> None:
    """httptools reads a body for a status under 100 (none is valid: RFC 9110 §15) and for a
    1xx other than 100, 102 and 103 that declares one (a 1xx cannot have content: §15.2).
    The gateway took the first as interim and the second's body as the final answer's: its
    bytes went to the client without a status line (then the client waited 60 s), or inside
    the final answer beyond its `Content-Length` (the client connection out of step: the
    next answer read after the stray bytes). Now such an answer is that upstream's protocol
    error: 502 naming it, and the client's kept-alive connection stays in step."""

    async def hostile(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(answer)
        await writer.drain()
        if b" 000 " in answer:  # (its body ends with the connection)
            writer.close()

    await start_raw(hostile)
    frontend = await started(start_frontend)
    live = b"GET /live HTTP/1.1\r\nhost: gateway\r\n\r\n"
    received = await asyncio.wait_for(raw_exchange(frontend.port, post() + live, responses=2), 10)
    assert received.startswith(b"HTTP/1.1 502 "), received[:200]
    assert b"injected" not in received
    assert b"status" in received.split(b"\r\n\r\n", 1)[1]
    assert count_responses(received) == 2 and received.endswith(b'{"status":"ok"}')
