"""A request without a valid key is refused on its head, before its body is read: a gateway
that read first buffered `--max-body` (16 MiB) per connection for anyone (20 connections
held 316 MB of an `--auth keys` frontend), and a byte every `--body-timeout` kept it so."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from shoal.frontend.http.head import DRAINED_BODY
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import count_responses, serving
from tests.frontend.test_client_limits import read_until_closed
from tests.frontend.test_keys import SECRET, grant
from tests.helpers import wait_for

BODY = json.dumps({"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}).encode()


def head(
    authorization: bytes | None, length: int, *extra: bytes, target: bytes = b"/v1/chat/completions"
) -> bytes:
    lines = [b"POST " + target + b" HTTP/1.1", b"Host: t", *extra]
    if authorization is not None:
        lines.append(b"Authorization: " + authorization)
    lines.append(b"Content-Length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def answer_to_head_alone(port: int, data: bytes) -> bytes:
    """What the server answers a request head whose declared body never comes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await read_until_closed(reader, timeout=5.0)  # (the body timeout: 30 s)
    finally:
        writer.close()


def error_of(received: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(received.partition(b"\r\n\r\n")[2])["error"]
    return error


@pytest.mark.parametrize("settings", [{"api_keys": ("s3cret",)}, {"auth": "keys"}])
@pytest.mark.parametrize(
    "authorization", [None, b"Bearer wrong", b"Basic czNjcmV0"], ids=["none", "wrong", "basic"]
)
async def test_a_request_without_a_valid_key_is_401_before_its_body_is_read(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    settings: dict[str, Any],
    authorization: bytes | None,
) -> None:
    worker = await start_worker("mock-llm")
    await grant(store, SECRET)
    frontend = await start_frontend(**settings)
    await wait_for(lambda: serving(frontend), message="served")
    received = await answer_to_head_alone(frontend.port, head(authorization, 8 << 20))
    assert received.startswith(b"HTTP/1.1 401 ")
    absolute = head(authorization, 8 << 20, target=b"http://gateway/v1/chat/completions")
    assert (await answer_to_head_alone(frontend.port, absolute)).startswith(b"HTTP/1.1 401 ")
    assert b"connection: close" in received.partition(b"\r\n\r\n")[0]
    assert error_of(received)["code"] == "invalid_api_key"
    assert worker.requests == 0


async def test_a_valid_key_still_sends_its_body_and_a_bad_one_is_answered_as_before(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """The head's check refuses only what the handler would: a valid key's large body is
    read and forwarded; a refused request from an allowed page still carries the CORS
    headers the page needs to read its 401."""
    worker = await start_worker("mock-llm")
    await grant(store, SECRET)
    frontend = await start_frontend(auth="keys", cors_origins=("https://app.example",))
    await wait_for(lambda: serving(frontend), message="served")
    padded = BODY[:-1] + b', "user": "' + b"u" * 600_000 + b'"}'
    valid = head(b"Bearer " + SECRET.encode(), len(padded), b"Connection: close") + padded
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(valid)
        received = await read_until_closed(reader)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 200 ") and worker.requests == 1
    origin = b"Origin: https://app.example"
    refused = await answer_to_head_alone(frontend.port, head(b"Bearer wrong", 1 << 20, origin))
    refused_head = refused.partition(b"\r\n\r\n")[0].lower()
    assert refused.startswith(b"HTTP/1.1 401 ")
    assert b"access-control-allow-origin: https://app.example" in refused_head


@pytest.mark.parametrize(
    "method, target",
    [
        (b"POST", b"/v1/models"),
        (b"PUT", b"/v1/chat/completions"),
        (b"OPTIONS", b"/v1/chat/completions"),
        (b"POST", b"/no/such/route"),
        (b"GET", b"/live"),
        (b"POST", b"/ui/api/login"),
    ],
)
async def test_a_request_to_any_other_route_is_not_let_send_max_body_without_a_key(
    store: Store, start_frontend: StartFrontend, method: bytes, target: bytes
) -> None:
    """Only a keyed request to a proxied route may send `--max-body`: any other request's body
    (a route that reads none, the dashboard's login) is bounded by `OTHER_BODY`. Before, a
    POST to /v1/models or any unknown path had its 8 MiB buffered for anyone, the head check
    notwithstanding (10 such connections: +160 MiB RSS)."""
    frontend = await start_frontend(api_keys=("s3cret",))
    declared = method + b" " + target + b" HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
    received = await answer_to_head_alone(frontend.port, declared % (8 << 20))
    assert received.startswith(b"HTTP/1.1 413 "), received[:200]
    # A chunked body, whose size no head declares, is refused once past the bound.
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(method + b" " + target + b" HTTP/1.1\r\nHost: t\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % (1 << 20) + b"x" * (1 << 20))
        received = await read_until_closed(reader, timeout=5.0)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 413 "), received[:200]


async def test_small_bodies_to_other_routes_are_answered_as_before(
    store: Store, start_frontend: StartFrontend
) -> None:
    """The bound leaves what a client sends alone: a dashboard login, a body on a GET."""
    frontend = await start_frontend(api_keys=("s3cret",))
    login = b'{"key": "s3cret"}'
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(
            b"POST /ui/api/login HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n" % len(login)
        )
        writer.write(b"Connection: close\r\n\r\n" + login)
        received = await read_until_closed(reader)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 200 ") and b"set-cookie" in received.lower()
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(
            b"GET /live HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
        )
        received = await read_until_closed(reader)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 200 ")


async def responses_on(reader: asyncio.StreamReader, received: bytes, count: int) -> bytes:
    """What the connection received once it holds `count` whole responses (or closed)."""
    async with asyncio.timeout(5.0):
        while count_responses(received) < count:
            chunk = await reader.read(65536)
            if not chunk:
                break
            received += chunk
    return received


@pytest.mark.parametrize(
    "settings, key", [({"api_keys": ("s3cret",)}, b"s3cret"), ({"auth": "keys"}, SECRET.encode())]
)
async def test_a_401_to_a_small_body_keeps_the_connection_for_the_retry_with_the_key(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    settings: dict[str, Any],
    key: bytes,
) -> None:
    """A refused request whose body is small (`DRAINED_BODY`) has its body read and dropped,
    and its connection kept: the client's retry with the right key goes on it (before: the
    401 closed it). A body that never comes is still answered on its head (the test above)."""
    worker = await start_worker("mock-llm")
    await grant(store, SECRET)
    frontend = await start_frontend(**settings)
    await wait_for(lambda: serving(frontend), message="served")
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(head(b"Bearer wrong", len(BODY)) + BODY)
        refused = await responses_on(reader, b"", 1)
        assert refused.startswith(b"HTTP/1.1 401 ")
        assert b"connection: close" not in refused.partition(b"\r\n\r\n")[0].lower()
        # The retry, and a refused one pipelined behind it: answered in order.
        writer.write(head(b"Bearer " + key, len(BODY)) + BODY + head(None, len(BODY)) + BODY)
        received = await responses_on(reader, b"", 2)
    finally:
        writer.close()
    assert received.startswith(b"HTTP/1.1 200 ") and worker.requests == 1
    assert received.index(b"HTTP/1.1 401 ") > 0  # (the second answer)


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: %d" % (DRAINED_BODY + 1),
        b"Transfer-Encoding: chunked",
        b"Expect: 100-continue",
    ],
    ids=["large", "chunked", "expect"],
)
async def test_a_401_to_a_large_chunked_or_awaited_body_still_closes_the_connection(
    store: Store, start_frontend: StartFrontend, framing: bytes
) -> None:
    """Past `DRAINED_BODY`, of a length not declared, or a body the client sends only after
    a 100 (it may never come): answered on the head, then closed, as before."""
    frontend = await start_frontend(api_keys=("s3cret",))
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: t", framing]
    if framing.startswith(b"Expect"):
        lines.append(b"Content-Length: %d" % len(BODY))
    received = await answer_to_head_alone(frontend.port, b"\r\n".join(lines) + b"\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 401 ")
    assert b"connection: close" in received.partition(b"\r\n\r\n")[0]
