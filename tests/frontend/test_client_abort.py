"""A client that leaves while its request is being answered: the instance's request stops
(its connection is dropped, as a worker sees a client go) and nothing leaks."""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import time
from typing import Any

import pytest

from shoal.frontend.http.upstream import Upstream, UpstreamConnection
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import StartRaw, completion, start_raw, until_closed
from tests.frontend.support import serving
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture

REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-length: 64\r\n\r\n"
    b'{"model":"mock-llm","messages":[{"role":"user","content":"hi"}]}'
)


async def answer(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(completion())


async def test_a_client_leaving_as_the_upstream_connect_completes_leaks_nothing(
    start_raw: StartRaw, start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream = await start_raw(answer)
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend), message="model served")
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    connected = asyncio.Event()
    real_connect = Upstream.connect

    async def connect_as_the_client_leaves(self: Upstream) -> UpstreamConnection:
        conn = await real_connect(self)
        # The client goes away in the same loop iteration as the connect completes: the
        # cancellation arrives, but the connect's result is delivered (as 3.11's wait_for can).
        assert frontend.server is not None
        for client in list(frontend.server.connections):
            client.connection_lost(None)
        connected.set()
        return conn

    monkeypatch.setattr(Upstream, "connect", connect_as_the_client_leaves)
    _, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    writer.write(REQUEST)
    await asyncio.wait_for(connected.wait(), 5)
    writer.close()
    monkeypatch.undo()
    await wait_for(lambda: upstream.open_connections == 1, message="the connection was accepted")
    gc.collect()  # a task that failed with nobody to see it reports it now
    (target,) = frontend.registry.models["mock-llm"].routable_sets[0].routable
    # The fresh connection is pooled for the next request, not left open with no owner.
    assert len(target.idle) == upstream.open_connections == 1
    assert target.in_flight == 0
    assert errors == []
    assert frontend.metrics.models["mock-llm"].in_flight == 0


async def sit(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await until_closed(reader)  # (a long generation: nothing until the gateway lets go)


@pytest.mark.parametrize(
    ("version", "connection", "leaves"),
    [
        ("1.1", "keep-alive", "fin"),  # (what httpx, aiohttp and the openai client do)
        ("1.1", "close", "fin"),
        ("1.0", "close", "fin"),
        ("1.1", "close", "rst"),
        ("1.1", "keep-alive", "rst"),
    ],
)
async def test_a_client_that_leaves_while_its_answer_is_awaited_stops_the_instances_request(
    start_raw: StartRaw, start_frontend: StartFrontend, version: str, connection: str, leaves: str
) -> None:
    """A FIN from a client whose answer is awaited is taken as the client gone, as vLLM's own
    server and nginx take it: a half-closed client's generation ran on to its end. After a
    request that ends the connection (`Connection: close`, HTTP/1.0), the socket is still
    read, so its FIN or reset is seen: reading had stopped, and the work ran on unseen."""
    upstream = await start_raw(sit)
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend), message="model served")
    request = REQUEST.replace(b"HTTP/1.1", f"HTTP/{version}".encode()).replace(
        b"host: gateway\r\n", f"host: gateway\r\nconnection: {connection}\r\n".encode()
    )
    sock = socket.create_connection(("127.0.0.1", frontend.port))
    try:
        sock.sendall(request)
        await wait_for(lambda: upstream.open_connections == 1, message="the request reached it")
        if leaves == "rst":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        else:
            sock.shutdown(socket.SHUT_WR)
        await wait_for(lambda: upstream.open_connections == 0, message="the request stopped")
        await wait_for(
            lambda: frontend.metrics.models["mock-llm"].in_flight == 0, message="in flight 0"
        )
    finally:
        sock.close()
    (target,) = frontend.registry.models["mock-llm"].routable_sets[0].routable
    assert target.in_flight == 0


async def endless_stream(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 8000 + b'"}}]}\n\n'
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    while True:  # (until the gateway lets go: the drain raises)
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()


async def test_a_client_that_reads_nothing_of_its_answer_is_cut_at_the_send_timeout(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """Its send buffer full, the instance's answer is paused, never its fault: without a
    bound the request held the instance (its KV cache, its batch slot) for good."""
    upstream = await start_raw(endless_stream)
    frontend = await start_frontend(send_timeout=0.5)
    await wait_for(lambda: serving(frontend), message="model served")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", frontend.port))
    try:
        sock.sendall(REQUEST)  # (and never reads a byte of the answer)
        await wait_for(lambda: upstream.open_connections == 1, message="streaming")
        await wait_for(lambda: upstream.open_connections == 0, message="the request stopped")
        await wait_for(
            lambda: frontend.metrics.models["mock-llm"].in_flight == 0, message="in flight 0"
        )
    finally:
        sock.close()


async def test_a_client_reading_a_large_answer_slowly_is_never_cut_by_the_send_timeout() -> None:
    """The send timeout is the time between two reads of the client (nginx's `send_timeout`),
    not the time until its buffer drains below the low-water mark: a client that read 64 KB
    every 10 ms of an 8 MB answer (more than the kernel's buffers hold) was cut."""
    from shoal.frontend.http.listener import HttpServer

    body = b"x" * (8 << 20)
    server = HttpServer(lambda _, conn: conn.send(200, body, b"text/plain"), max_body=1 << 20,
                        send_timeout=0.3)  # fmt: skip
    await server.start("127.0.0.1", 0)

    def read_slowly() -> int:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
            got = 0
            while got < len(body):
                time.sleep(0.01)  # (a slow reader's pace, not a wait for anything)
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    break
                if not data:
                    break
                got += len(data)
            return got

    try:
        got = await asyncio.get_running_loop().run_in_executor(None, read_slowly)
    finally:
        await server.close(0.1)
    assert got >= len(body)  # (the head too: more than the body)
