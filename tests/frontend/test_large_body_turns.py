"""A connection that reads a large body quickly lets the event loop turn between its reads.

On uvloop (the loop `shoal frontend` runs on) libuv reads a readable socket up to 32 times
in one go, so a fast sender's 8 MB, and the parsing of each read, could hold the loop while
every other connection waited; after each `TURN_BYTES` read, the connection pauses reading
until the loop's next turn."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from shoal.frontend.http import server
from tests.frontend.conftest import StartFrontend

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])  # as `shoal frontend` runs


def send_fast(port: int, data: bytes) -> None:
    """Write `data` from another thread, as fast as the socket takes it (a blocking send
    lets go of the GIL), and read the answer."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(data)
        sock.recv(65536)


@pytest.mark.parametrize("turn_bytes", [server.TURN_BYTES, 1 << 40])
async def test_a_fast_sender_of_a_large_body_gives_the_loop_a_turn_every_turn_bytes(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch, turn_bytes: int
) -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    monkeypatch.setattr(server, "TURN_BYTES", turn_bytes)
    frontend = await start_frontend(max_body=64 << 20)
    turn = 0
    read_in_turn: dict[int, int] = {}
    received = server.HttpConnection.data_received

    def counted(self: server.HttpConnection, data: bytes) -> None:
        read_in_turn[turn] = read_in_turn.get(turn, 0) + len(data)
        received(self, data)

    monkeypatch.setattr(server.HttpConnection, "data_received", counted)
    done = False

    def tick() -> None:
        nonlocal turn
        turn += 1
        if not done:
            asyncio.get_running_loop().call_soon(tick)

    body = (
        b'{"model":"nobody","messages":[' + b'{"role":"user","content":"hi"},' * 400_000 + b"{}]}"
    )
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    data = head + b"content-length: %d\r\n\r\n" % len(body) + body
    tick()
    try:
        await asyncio.to_thread(send_fast, frontend.port, data)
    finally:
        done = True
    most = max(read_in_turn.values())
    if turn_bytes == server.TURN_BYTES:
        assert most <= server.TURN_BYTES + (256 << 10), f"{most} bytes read in one turn"
    else:  # (the same without turns given: the test can tell)
        assert most > 2 * server.TURN_BYTES + (256 << 10), f"{most} bytes read in one turn"


async def test_a_body_in_one_byte_chunks_gives_the_loop_a_turn_every_turn_calls(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget counted bytes only: 256 KiB of 1-byte chunks is ~44,000 parser callbacks
    (`on_body`), parsed in one callback (~40 ms of the loop). Past `TURN_CALLS` callbacks,
    the rest is parsed in the loop's next turn."""
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    frontend = await start_frontend(max_body=4 << 20)
    turn = 0
    calls_in_turn: dict[int, int] = {}
    on_body = server.HttpConnection.on_body

    def counted(self: server.HttpConnection, body: bytes) -> None:
        calls_in_turn[turn] = calls_in_turn.get(turn, 0) + 1
        on_body(self, body)

    monkeypatch.setattr(server.HttpConnection, "on_body", counted)
    done = False

    def tick() -> None:
        nonlocal turn
        turn += 1
        if not done:
            asyncio.get_running_loop().call_soon(tick)

    body = b'{"model":"nobody","messages":[' + b'{"role":"user","content":"hi"},' * 8000 + b"{}]}"
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    data = head + b"".join(b"1\r\n%c\r\n" % c for c in body) + b"0\r\n\r\n"
    tick()
    try:
        await asyncio.to_thread(send_fast, frontend.port, data)
    finally:
        done = True
    assert sum(calls_in_turn.values()) == len(body)  # (each byte its callback: none lost)
    most = max(calls_in_turn.values())
    # (two slices may start in one turn, each past the budget by one `FEED_SLICE` at most)
    assert most <= 2 * (server.TURN_CALLS + server.FEED_SLICE // 6), f"{most} in one turn"
