"""HEAD answers like GET without a body; CORS is off unless origins are configured, and then
preflights and actual responses (built-in and proxied) carry the right headers."""

from __future__ import annotations

import asyncio

from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import count_responses, raw_exchange, serving
from tests.helpers import wait_for

ORIGIN = "https://app.example"


def head_of(response: bytes) -> dict[str, str]:
    lines = response.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
    return {name.lower(): value.strip() for name, _, value in (x.partition(":") for x in lines)}


async def test_head_is_answered_like_get_without_a_body(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend()
    get = await raw_exchange(frontend.port, b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n")
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        # A HEAD then a GET on one connection: a stray body would be read as the next answer.
        writer.write(b"HEAD /live HTTP/1.1\r\nHost: t\r\n\r\nGET /live HTTP/1.1\r\nHost: t\r\n\r\n")
        received = b""
        async with asyncio.timeout(5):
            while received.count(b"HTTP/1.1 ") < 2 or count_responses(received) < 1:
                received += await reader.read(65536)
            while not received.endswith(get.partition(b"\r\n\r\n")[2]):
                received += await reader.read(65536)
    finally:
        writer.close()
    head_answer, _, rest = received.partition(b"\r\n\r\n")
    assert head_answer.startswith(b"HTTP/1.1 200 OK")
    assert head_of(received)["content-length"] == head_of(get)["content-length"]
    assert rest == get  # the HEAD answer carried no body: the GET's answer follows at once


async def test_head_on_models_is_200(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend()
    head = b"HEAD /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    received = await raw_exchange(frontend.port, head, responses=99)  # read until closed
    assert received.startswith(b"HTTP/1.1 200 OK")
    assert received.endswith(b"\r\n\r\n")


async def test_cors_is_off_by_default(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend()
    get = f"GET /v1/models HTTP/1.1\r\nHost: t\r\nOrigin: {ORIGIN}\r\n\r\n".encode()
    received = await raw_exchange(frontend.port, get)
    assert received.startswith(b"HTTP/1.1 200 ")
    assert b"access-control-" not in received.lower()


def preflight(origin: str, method: str = "POST") -> bytes:
    return (
        f"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: t\r\nOrigin: {origin}\r\n"
        f"Access-Control-Request-Method: {method}\r\n"
        "Access-Control-Request-Headers: authorization, content-type\r\n\r\n"
    ).encode()


async def test_preflight_from_an_allowed_origin_is_answered_without_a_key(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(cors_origins=(ORIGIN,), api_keys=("secret",))
    received = await raw_exchange(frontend.port, preflight(ORIGIN))
    assert received.startswith(b"HTTP/1.1 204 ")
    headers = head_of(received)
    assert headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert "origin" in headers["vary"]
    assert "content-length" not in headers  # 204: no body, no length (RFC 9110 §8.6)


async def test_preflight_from_another_origin_is_refused(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend(cors_origins=(ORIGIN,))
    received = await raw_exchange(frontend.port, preflight("https://evil.example"))
    assert received.startswith(b"HTTP/1.1 403 ")
    assert b"access-control-allow-origin" not in received.lower()


async def test_wildcard_origin_allows_any_page(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend(cors_origins=("*",))
    received = await raw_exchange(frontend.port, preflight("http://localhost:3000"))
    assert head_of(received)["access-control-allow-origin"] == "http://localhost:3000"


async def test_allowed_origin_gets_cors_headers_on_proxied_and_builtin_answers(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await start_frontend(cors_origins=(ORIGIN,))
    await wait_for(lambda: serving(frontend))
    body = b'{"model":"mock-llm","messages":[]}'
    for stream in (b"false", b"true"):
        data = body[:-1] + b',"stream":' + stream + b"}"
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nOrigin: %s\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (ORIGIN.encode(), len(data), data)
        )
        received = await raw_exchange(frontend.port, request)
        assert received.startswith(b"HTTP/1.1 200 OK\r\n")
        headers = head_of(received)
        assert headers["access-control-allow-origin"] == ORIGIN
        assert "x-shoal-instance" in headers  # the proxy's own head is intact
    models = f"GET /v1/models HTTP/1.1\r\nHost: t\r\nOrigin: {ORIGIN}\r\n\r\n".encode()
    assert (
        head_of(await raw_exchange(frontend.port, models))["access-control-allow-origin"] == ORIGIN
    )
    assert worker.requests == 2
