"""What the gateway holds for a stream that may migrate stays bounded, whatever the stream."""

from __future__ import annotations

import json
import time
import tracemalloc
from types import SimpleNamespace
from typing import Any

from shoal.frontend.proxy.migration import MAX_CARRIED, Migration


def _migration() -> Migration:
    forward: Any = SimpleNamespace(status=200, target=None, model=None)
    return Migration(forward, True, 1, None)


def _event(content: str) -> bytes:
    chunk = {"id": "c", "created": 1, "choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def test_the_text_kept_of_many_tiny_chunks_costs_about_its_own_size() -> None:
    """100,000 chunks of two characters: the text kept for a continuation is 200,000
    characters, and costs about that (not a Python string object per chunk)."""
    migration = _migration()
    events = _event("ab") * 1000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(100):
            migration.feed(events)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert migration.tokens == 100_000
    assert held < 2_000_000, held  # a string per chunk held ~6 MB


def test_one_long_event_dripped_in_small_reads_costs_linear_time() -> None:
    """An event of almost `MAX_EVENT` bytes arriving 512 bytes at a time is held until its
    end without copying what came before at every read."""
    event = _event("x" * (MAX_CARRIED - 1000))
    migration = _migration()
    started = time.perf_counter()
    out = [migration.feed(event[i : i + 512]) for i in range(0, len(event), 512)]
    elapsed = time.perf_counter() - started
    assert b"".join(out) == event
    assert elapsed < 0.5, elapsed


def test_events_split_anywhere_pass_whole_and_are_read_once() -> None:
    stream = _event("a") + _event("bc") + b"data: [DONE]\n\n"
    for size in (1, 2, 3, 7, 64):
        migration = _migration()
        out = [migration.feed(stream[i : i + size]) for i in range(0, len(stream), size)]
        assert b"".join(out) == stream and migration.parsing
        assert migration.tokens == 2 and migration.done
        assert migration.text.getvalue() == "abc"
    crlf = _migration()
    framed = _event("a").replace(b"\n\n", b"\r\n\r\n")
    out = [crlf.feed(framed[i : i + 1]) for i in range(len(framed))]
    assert b"".join(out) == framed and not crlf.parsing and crlf.refused == "framing"
