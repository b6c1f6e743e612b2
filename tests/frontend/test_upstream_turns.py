"""A worker's or provider's response body is parsed a bounded number of pieces per turn of
the event loop: a body in 1-byte chunks (a million parser callbacks for 1 MB) held the loop
for seconds while every other request waited."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import uvloop

from shoal.frontend.http import upstream
from shoal.frontend.proxy.forward import Forward
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import StartRaw, start_raw
from tests.frontend.support import serving
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture

EVENT = (
    b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"mock-llm",'
    b'"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
)
EVENTS = 200
SSE = EVENT * EVENTS + b"data: [DONE]\n\n"


# uvloop, as `shoal frontend` runs: libuv reads a fast sender many times in one turn.
pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])


def one_byte_chunks(body: bytes) -> bytes:
    return b"".join(b"1\r\n%c\r\n" % c for c in body) + b"0\r\n\r\n"


async def one_byte_stream(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + one_byte_chunks(SSE)
    )


async def one_byte_error(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    body = json.dumps({"error": {"message": "x" * 30_000, "type": "invalid"}}).encode()
    writer.write(
        b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + one_byte_chunks(body)
    )


@pytest.mark.parametrize("stream", [True, False])
async def test_a_body_in_one_byte_chunks_is_parsed_turn_calls_pieces_a_turn_and_arrives_whole(
    start_raw: StartRaw, start_frontend: StartFrontend, stream: bool
) -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    await start_raw(one_byte_stream if stream else one_byte_error)
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend))
    # uvloop has no `_run_once` to count (tests/helpers.py LoopTurns): a callback that
    # schedules itself again runs once per turn, and numbers the turns
    turn, done = 0, False
    calls_in_turn: dict[int, int] = {}
    on_packet = Forward.on_packet  # (the parser appends pieces to a list: given per packet)

    def counted(self: Forward, bodies: list[bytes]) -> None:
        calls_in_turn[turn] = calls_in_turn.get(turn, 0) + len(bodies)
        on_packet(self, bodies)

    def tick() -> None:
        nonlocal turn
        turn += 1
        if not done:
            asyncio.get_running_loop().call_soon(tick)

    body = {"model": "mock-llm", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    tick()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Forward, "on_packet", counted)
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
            ):
                got = await response.read()
    finally:
        done = True
    if stream:
        assert response.status == 200
        assert got == SSE  # every event, whole and in order
    else:
        assert response.status == 400
        assert json.loads(got)["error"]["message"] == "x" * 30_000
    # (each byte a piece: what is bounded; the last slice's go with the end, not counted)
    assert sum(calls_in_turn.values()) >= 30_000 - upstream.FEED_SLICE // 6
    # one slice may start past the bound: at most a slice's pieces more (6 bytes each)
    most = max(calls_in_turn.values())
    assert most <= upstream.TURN_CALLS + upstream.FEED_SLICE // 6, f"{most} pieces in one turn"
