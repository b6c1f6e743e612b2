"""A client that leaves while its request is being answered: the instance's request stops
(its connection is dropped, as a worker sees a client go) and nothing leaks."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import struct
import sys
import time
from typing import Any, cast

import pytest

from shoal.frontend.http.server import HttpConnection
from shoal.frontend.http.unread import Unread, socket_unsent
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


@pytest.mark.parametrize(
    ("request_line", "keepalive_timeout"),
    [
        (b"GET /short HTTP/1.1\r\nhost: x\r\n\r\n", 60.0),  # the connection stays open
        (b"GET /short HTTP/1.1\r\nhost: x\r\n\r\n", 0.2),  # the keep-alive close
        (b"GET /short HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", 60.0),  # linger close
    ],
)
async def test_a_client_that_reads_nothing_of_a_short_answer_is_dropped_at_the_send_timeout(
    request_line: bytes, keepalive_timeout: float
) -> None:
    """The send timeout counted only while writing was paused (over 64 KiB unsent): a client
    that read nothing of a shorter answer, the kernel's buffers full, kept its connection
    (and its slot of `max_connections`) for good, the keep-alive and linger closes waiting
    for the bytes to go. Bytes unsent and not shrinking are timed whatever the connection's
    state: the connection is dropped."""
    from shoal.frontend.http.listener import HttpServer

    body = b"x" * 40_000  # (under the 64 KiB mark: writing is never paused)

    def handler(_: object, conn: HttpConnection) -> None:
        assert conn.transport is not None
        sock = conn.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # (the kernel holds little)
        conn.send(200, body, b"text/plain")

    server = HttpServer(handler, max_body=1 << 20, keepalive_timeout=keepalive_timeout,
                        send_timeout=0.3)  # fmt: skip
    await server.start("127.0.0.1", 0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        await asyncio.get_running_loop().sock_sendall(sock, request_line)  # (never reads)
        conn = await wait_for(lambda: next(iter(server.connections), None), message="accepted")
        await wait_for(lambda: conn.response_started and conn.idle, message="answered")
        assert conn.transport is not None
        assert conn.transport.get_write_buffer_size() > 0 and not conn.writing_paused
        await wait_for(lambda: conn not in server.connections, message="dropped")
        assert conn.closed
    finally:
        sock.close()
        await server.close(0.1)


class Buffered:
    """A transport as `Unread` sees it: the bytes in its write buffer, no socket."""

    def __init__(self) -> None:
        self.unsent = 0

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def get_extra_info(self, name: str) -> None:
        return None


def test_an_unread_wait_is_timed_while_bytes_wait_and_none_leave() -> None:
    """`Unread`, the send timeout's bookkeeping: bytes waiting that did not shrink between two
    sweeps are a wait (writing paused or not); fewer (the client read), none, or more below
    the mark (the client may have read meanwhile) start it again."""
    buffered = Buffered()
    transport = cast(asyncio.Transport, buffered)

    def overdue(unread: Unread, unsent: int, paused: bool, now: float, timeout: float) -> bool:
        buffered.unsent = unsent
        return unread.overdue(transport, paused, now, timeout)

    unread = Unread()
    assert not overdue(unread, 1000, False, 10.0, 1.0)  # a wait starts
    assert not overdue(unread, 1000, False, 10.5, 1.0)
    assert overdue(unread, 1000, False, 11.5, 1.0)  # unchanged past the timeout
    unread = Unread()
    assert not overdue(unread, 1000, False, 10.0, 1.0)
    assert not overdue(unread, 900, False, 10.9, 1.0)  # it read: a new wait from 10.9
    assert not overdue(unread, 900, False, 11.5, 1.0)
    assert overdue(unread, 900, False, 12.0, 1.0)
    unread = Unread()
    assert not overdue(unread, 1000, False, 10.0, 1.0)
    assert not overdue(unread, 2000, False, 10.9, 1.0)  # more, below the mark: a new wait
    assert not overdue(unread, 2000, False, 11.5, 1.0)
    assert not overdue(unread, 0, False, 12.5, 1.0)  # all sent: no wait
    assert not overdue(unread, 70_000, True, 13.0, 1.0)  # paused: a wait starts
    assert not overdue(unread, 80_000, True, 13.5, 1.0)  # more while paused: the same wait
    assert overdue(unread, 80_000, True, 14.5, 1.0)
    unread = Unread()
    assert not overdue(unread, 1000, False, 10.0, 0.0)
    assert not overdue(unread, 1000, False, 1e9, 0.0)  # 0: no limit


async def test_the_bytes_a_socket_holds_unacknowledged_count_as_unread() -> None:
    """While the write buffer waits for the kernel's room, the client's reads show only in
    what its socket holds (Linux: `SIOCOUTQ`), which the kernel takes in bursts: a client
    reading a large answer slowly would be cut, its buffer unchanged between two bursts."""
    if sys.platform != "linux":
        pytest.skip("the socket's count is read on Linux only")

    class Sock:
        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

        def get_extra_info(self, name: str) -> socket.socket:
            return self.sock

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(listener.getsockname())
            server_side, _ = listener.accept()
            with server_side:
                server_side.setblocking(False)
                sent = 0
                with contextlib.suppress(BlockingIOError):
                    while True:  # (until the kernel holds no more)
                        sent += server_side.send(b"x" * 65536)
                transport = cast(asyncio.Transport, Sock(server_side))
                held = socket_unsent(transport)
                assert 0 < held <= sent
                assert client.recv(65536)
                await wait_for(lambda: socket_unsent(transport) < held, message="acknowledged")
