"""A stream that may migrate is read in batches (`Migration.catch_up`): what it keeps (the
text, the tokens, the id, the end, why it could not migrate) is what reading each event on
its own keeps, however the events come and whatever they hold."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.frontend.proxy.migration import READ_BATCH, Migration

_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6)


@st.composite
def _event(draw: st.DrawFn) -> bytes:
    kinds = ["content", "content", "content", "role", "finish", "tool", "completion", "comment",
             "blank", "done", "done-tight", "unreadable", "two-lines", "number", "spaced",
             "usage", "two-objects", "a-line-then-done", "fields-first", "blank-first",
             "no-id"]  # fmt: skip
    kind = draw(st.sampled_from(kinds))
    piece = draw(_text)
    chunk: dict[str, Any] = {"id": "c-1", "object": "chat.completion.chunk", "created": 7}
    if kind == "content":
        chunk["choices"] = [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]
    elif kind == "role":
        chunk["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    elif kind == "finish":
        chunk["choices"] = [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    elif kind == "tool":
        chunk["choices"] = [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]
    elif kind == "completion":
        chunk["choices"] = [{"index": 0, "text": piece, "finish_reason": None}]
    elif kind == "usage":
        chunk["choices"], chunk["usage"] = [], {"completion_tokens": 3}
    elif kind == "comment":
        return b": keep-alive\n\n"
    elif kind == "blank":
        return b"\n\n"
    elif kind == "done":
        return b"data: [DONE]\n\n"
    elif kind == "done-tight":
        return b"data:[DONE]\n\n"
    elif kind == "unreadable":
        return b'data: {"id": "c-1", "choices": [\n\n'
    elif kind == "two-lines":
        return b'data: {"id": "c-1",\ndata: "choices": []}\n\n'
    elif kind == "number":
        return b"data: 12\n\n"
    elif kind == "no-id":
        chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
    elif kind == "fields-first":  # (SSE: other fields and comments before the data)
        chunk["choices"] = [{"index": 0, "delta": {"content": piece}}]
        return b"event: message\nid: 4\n: note\ndata: " + json.dumps(chunk).encode() + b"\n\n"
    elif kind == "blank-first":  # (an empty line more: `\n\n\n` after the last event)
        chunk["choices"] = [{"index": 0, "delta": {"content": piece}}]
        return b"\ndata: " + json.dumps(chunk).encode() + b"\n\n"
    elif kind == "a-line-then-done":  # (one event of two lines: unreadable, not the end)
        return b'data: {"choices":[]}\ndata: [DONE]\n\n'
    elif kind == "two-objects":  # (one event, no chunk: unless read as part of an array)
        return b'data: {"choices":[{"delta":{"content":"x"}}]},{"id":"c-2"}\n\n'
    if kind == "spaced":
        chunk["choices"] = [{"index": 0, "delta": {"content": piece}}]
        return b"data:" + json.dumps(chunk, indent=1).replace("\n", " ").encode() + b"  \n\n"
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _expected(events: list[bytes]) -> dict[str, Any]:
    """What reading each event on its own keeps (the reference, with `json`)."""
    kept: dict[str, Any] = {"text": "", "tokens": 0, "done": False, "finished": False,
                            "refused": None, "opened": False, "id": None}  # fmt: skip
    for event in events:
        lines = event[:-2].split(b"\n")  # (SSE: the data lines' values, joined by newlines)
        values = [line[5:] for line in lines if line.startswith(b"data:")]
        if not values:
            continue
        payload = b"\n".join(v[1:] if v.startswith(b" ") else v for v in values).strip()
        if payload == b"[DONE]":
            kept["done"] = True
            continue
        try:
            chunk = json.loads(payload)
            assert isinstance(chunk, dict)
        except (ValueError, AssertionError):
            kept["refused"] = kept["refused"] or "unreadable"
            continue
        kept["opened"] = True
        if kept["id"] is None:
            kept["id"] = chunk.get("id")  # (the first chunk that has one)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            piece = choice.get("text") if delta is None else delta.get("content")
            if delta is not None and delta.get("tool_calls"):
                kept["refused"] = kept["refused"] or "tool_calls"
            if isinstance(piece, str) and piece:
                kept["tokens"] += 1
                kept["text"] += piece
            if choice.get("finish_reason") is not None:
                kept["finished"] = True
        completion = (chunk.get("usage") or {}).get("completion_tokens")
        if isinstance(completion, int):  # (the engine's count: a chunk may carry several)
            kept["tokens"] = max(kept["tokens"], completion)
    return kept


def _kept(migration: Migration) -> dict[str, Any]:
    return {"text": migration.text.getvalue(), "tokens": migration.tokens,
            "done": migration.done, "finished": migration.finished,
            "refused": migration.refused, "opened": migration.opened,
            "id": migration.id}  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.lists(_event(), min_size=1, max_size=40), st.lists(st.integers(1, 400), max_size=30))
def test_reading_in_batches_keeps_what_reading_each_event_keeps(
    events: list[bytes], cuts: list[int]
) -> None:
    stream = b"data: " + json.dumps({"id": "c-1", "choices": []}).encode() + b"\n\n"
    stream += b"".join(events)
    forward: Any = SimpleNamespace(status=200, target=None, model=None)
    migration = Migration(forward, True, 1, None)
    out, at = [], 0
    for size in cuts:
        out.append(migration.feed(stream[at : at + size]))
        at += size
    out.append(migration.feed(stream[at:]))
    migration.catch_up()
    out.append(migration.rest())  # (at a normal end: `Forward.on_complete` sends it)
    assert b"".join(out) == stream  # (whole events: all of them reached the client)
    expected = _expected([stream[: stream.index(b"\n\n") + 2], *events])
    assert _kept(migration) == expected
    # At the end, whether the stream ended is what reading each event says, read or not
    # (`complete` does not read events that end with `[DONE]`).
    again = Migration(forward, True, 1, None)
    again.feed(stream)
    assert again.complete() == (expected["done"] or expected["finished"])


def test_a_last_blank_line_that_comes_alone_reaches_the_client_at_the_end() -> None:
    """An extra newline after the last event, in a packet of its own, is held as the start
    of an event; at a normal end `rest` gives it back (the client gets every byte)."""
    event = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    forward: Any = SimpleNamespace(status=200, target=None, model=None)
    migration = Migration(forward, True, 1, None)
    out = [migration.feed(event + b"\n"), migration.feed(b"\n"), migration.feed(b"\n")]
    migration.catch_up()
    out.append(migration.rest())
    assert b"".join(out) == event + b"\n\n\n"
    assert migration.text.getvalue() == "a"


def test_a_long_stream_is_read_as_it_goes_not_held_unread() -> None:
    """What is kept unread stays under `READ_BATCH` bytes however long the stream: the
    events of a 100,000-token stream are not held until its end."""
    event = b'data: {"id":"c","created":1,"choices":[{"index":0,"delta":{"content":"ab"}}]}\n\n'
    forward: Any = SimpleNamespace(status=200, target=None, model=None)
    migration = Migration(forward, True, 1, None)
    most = 0
    for _ in range(100_000):
        migration.feed(event)
        most = max(most, migration.unread_size)
    assert most < READ_BATCH
    assert migration.tokens > 99_000  # (read as it went: all but the last batch)
    migration.catch_up()
    assert migration.tokens == 100_000 and migration.size == 200_000


def test_a_stream_that_ends_with_its_done_is_never_read() -> None:
    """Most streams never fail: one that ends with `data: [DONE]` before `READ_BATCH` bytes
    is complete without a decode of its events (they were kept, not read)."""
    event = b'data: {"id":"c","created":1,"choices":[{"index":0,"delta":{"content":"ab"}}]}\n\n'
    forward: Any = SimpleNamespace(status=200, target=None, model=None)
    migration = Migration(forward, True, 1, None)
    for _ in range(READ_BATCH // len(event) - 2):
        assert migration.feed(event) == event
    assert migration.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert migration.complete()
    assert migration.done and migration.tokens == 0 and migration.unread == []
    # Without its `[DONE]`, the end is read for a finish reason.
    unfinished = Migration(forward, True, 1, None)
    for _ in range(3):
        unfinished.feed(event)
    assert not unfinished.complete() and unfinished.tokens == 3
    unfinished.feed(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')
    assert unfinished.complete() and unfinished.finished
