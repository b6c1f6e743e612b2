"""What the gateway looks for in a stream's packets to send the client whole events only
(`sse.whole_events`, `Forward.on_body`), and what it does not have to look at."""

from __future__ import annotations

import pytest
from bench.request_path import Bench
from hypothesis import given
from hypothesis import strategies as st

from shoal.frontend.proxy import sse


def whole_events_by_lines(data: bytes) -> int:
    """The end of `data`'s last empty line, read a line at a time as an SSE client does
    (lines end with CRLF, LF or CR, mixed at will); `data` may start inside a line."""
    end, start, i = 0, -1, 0
    while i < len(data):
        if data[i] in b"\r\n":
            stop = i + 2 if data[i : i + 2] == b"\r\n" else i + 1
            if i == start:
                end = stop
            start = i = stop
        else:
            i += 1
    return end


@given(st.lists(st.sampled_from([b"a", b"\n", b"\r", b"data: x"]), max_size=40))
def test_whole_events_ends_where_an_sse_reader_sees_the_last_empty_line(
    pieces: list[bytes],
) -> None:
    data = b"".join(pieces)
    assert sse.whole_events(data) == whole_events_by_lines(data)


def every_ended_event_in(out: bytes, data: bytes) -> bool:
    """Whether `out`, the start of `data`, holds each event `data` ends (a client reads a CR
    as a line's end at once: the LF of a blank line's CRLF may follow later)."""
    end = whole_events_by_lines(data)
    return len(out) >= end or (len(out) == end - 1 and data[end - 2 : end] == b"\r\n")


def relayed(packets: list[bytes]) -> tuple[bytes, bytes]:
    """What the client has after `packets` of a chunked stream of one instance, as
    `Forward.on_body` passes them (a packet ending with a newline goes as it is; others
    through `sse.Unfinished`, told the last bytes relayed), and what is held."""
    held: sse.Unfinished | None = None
    out = tail = b""
    for data in packets:
        if held is None and data[-1] == 10:
            sent = data
        else:
            held = held or sse.Unfinished()
            sent = held.take(data, tail[-2:])
            held = held if held.size else None
        if sent:
            out, tail = out + sent, sent
    return out, b"".join(held.pieces) if held is not None else b""


@pytest.mark.parametrize(
    "packets",
    [
        [b"data: a\r", b"\n", b"\r", b"\n"],  # CRLF, the blank line's cut into reads
        [b"data: a\r\n", b"\r", b"\n"],
        [b"data: a\n\r\n"],  # an LF line, then a CRLF blank line
        [b"data: a\n\r", b"\n"],
        [b"data: a\n", b"\ndata: b"],  # the blank line starts the next read
        [b"data: a\r\n", b"\r\ndata: b"],
        [b"data: a", b"\n", b"\n"],
    ],
)
def test_an_event_whose_blank_line_is_cut_between_reads_reaches_the_client_when_it_ends(
    packets: list[bytes],
) -> None:
    out, held = relayed(packets)
    data = b"".join(packets)
    assert out == data[: len(out)] and out + held == data  # nothing lost, nothing moved
    assert every_ended_event_in(out, data)


@given(
    st.lists(st.sampled_from([b"data: x", b"\n", b"\r", b"\r\n", b"\n\n", b"y"]), max_size=30),
    st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=30),
)
def test_every_event_that_ended_is_relayed_however_the_stream_is_cut_into_reads(
    pieces: list[bytes], cuts: list[int]
) -> None:
    data = b"".join(pieces)
    packets, at = [], 0
    for size in cuts * (len(data) // max(1, sum(cuts)) + 1):
        if at >= len(data):
            break
        packets.append(data[at : at + size])
        at += size
    if at < len(data):
        packets.append(data[at:])
    out, held = relayed(packets)
    assert out + held == data
    assert every_ended_event_in(out, data)


async def test_a_stream_of_one_packet_with_its_length_is_not_searched_for_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream answered with a `Content-Length` cannot end with the gateway's error event
    (cut short, its connection is closed): its packets are relayed without a search for
    the end of their last event (22 KB searched three times over, a request: 1.8x the
    instructions of the stream). A chunked one is still held to whole events."""
    searched: list[int] = []
    real = sse.whole_events

    def counted(data: bytes) -> int:
        searched.append(len(data))
        return real(data)

    monkeypatch.setattr(sse, "whole_events", counted)
    bench = Bench(chunks=128)
    bench.serve("whole", 5)
    bench.check()
    assert searched == []
    bench.serve("stream", 1)  # (chunked, one packet an event: each ends its event)
    bench.check()
    assert searched, "a chunked stream's first packet is looked at"
