"""What the gateway looks for in a stream's packets to send the client whole events only
(`sse.whole_events`, `Forward.on_body`), and what it does not have to look at."""

from __future__ import annotations

import pytest
from bench.request_path import Bench
from hypothesis import given
from hypothesis import strategies as st

from shoal.frontend.proxy import sse


def whole_events_by_every_search(data: bytes) -> int:
    """The length of `data`'s whole events, each kind of blank line searched in all of it."""
    ends = [at + len(b) for b in (b"\n\n", b"\r\n\r\n", b"\r\r") if (at := data.rfind(b)) >= 0]
    return max(ends, default=0)


@given(st.lists(st.sampled_from([b"a", b"\n", b"\r", b"data: x"]), max_size=40))
def test_whole_events_ends_where_a_search_of_every_blank_line_in_all_the_packet_ends(
    pieces: list[bytes],
) -> None:
    data = b"".join(pieces)
    assert sse.whole_events(data) == whole_events_by_every_search(data)


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
