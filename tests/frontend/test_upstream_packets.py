"""What an upstream connection hands its sink: each packet's pieces of body in one call
(`ResponseSink.on_packet`, the parser appending them itself), in order; the pieces of the
packet that ends the response before its end; the pieces before a fault before the failure."""

from __future__ import annotations

from typing import Any

from shoal.frontend.http.upstream import Upstream, UpstreamConnection

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Transport:
    def __init__(self) -> None:
        self.closing = False

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    abort = close


class Sink:
    """Records what it is given, in order."""

    def __init__(self, fail_on_packet: bool = False) -> None:
        self.seen: list[Any] = []
        self.fail_on_packet = fail_on_packet

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], chunked: bool) -> bool:
        self.seen.append(("head", status))
        return True

    def on_body(self, data: bytes) -> None:
        self.seen.append(("body", data))

    def on_packet(self, bodies: list[bytes]) -> None:
        self.seen.append(("packet", list(bodies)))
        if self.fail_on_packet and bodies:
            raise ValueError("the sink refuses this")

    def on_complete(self) -> None:
        self.seen.append(("complete",))

    def on_failure(self, exc: Exception) -> None:
        self.seen.append(("failure", str(exc)))


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def connected(sink: Sink) -> tuple[Upstream, UpstreamConnection, Transport]:
    upstream = Upstream(1, "http://127.0.0.1:9")
    conn = UpstreamConnection(upstream)
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.send(b"GET / HTTP/1.1\r\nhost: w\r\n\r\n", b"", sink)
    return upstream, conn, transport


def test_a_packets_pieces_reach_the_sink_in_one_call_in_order() -> None:
    sink = Sink()
    upstream, conn, _ = connected(sink)
    conn.data_received(HEAD)
    conn.data_received(chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n") + b"5\r\ndat")
    conn.data_received(b"a:\r\n")
    assert sink.seen == [
        ("head", 200),
        ("packet", []),  # (a packet of the head alone: nothing to pass on, but it came)
        ("packet", [b"data: 1\n\n", b"data: 2\n\n", b"dat"]),
        ("packet", [b"a:"]),
    ]
    conn.data_received(chunk(b"\n\n") + b"0\r\n\r\n")  # (the last piece and the end at once)
    assert sink.seen[4:] == [("body", b"\n\n"), ("complete",)]  # (no packet after the end)
    assert upstream.idle == [conn]  # (pooled, its next exchange starts with nothing held)
    second = Sink()
    conn.send(b"GET / HTTP/1.1\r\nhost: w\r\n\r\n", b"", second)
    conn.data_received(HEAD + chunk(b"data: 3\n\n"))
    assert second.seen == [("head", 200), ("packet", [b"data: 3\n\n"])]


def test_pieces_before_a_malformed_chunk_reach_the_sink_before_the_failure() -> None:
    sink = Sink()
    upstream, conn, transport = connected(sink)
    conn.data_received(HEAD + chunk(b"data: 1\n\n") + b"zz\r\n")
    assert sink.seen[:2] == [("head", 200), ("body", b"data: 1\n\n")]
    assert sink.seen[2][0] == "failure" and "malformed response" in sink.seen[2][1]
    assert len(sink.seen) == 3 and transport.closing and upstream.idle == []


def test_a_sink_that_raises_on_a_packet_fails_its_response() -> None:
    """As a parser callback that raised did: the response fails, the connection is dropped."""
    sink = Sink(fail_on_packet=True)
    upstream, conn, transport = connected(sink)
    conn.data_received(HEAD)
    conn.data_received(chunk(b"data: 1\n\n"))
    assert sink.seen[-1][0] == "failure" and "the sink refuses this" in sink.seen[-1][1]
    assert transport.closing and conn.sink is None and upstream.idle == []
