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
        migration.catch_up()  # (what the client got is read before a failure or the end)
        assert migration.tokens == 2 and migration.done
        assert migration.text.getvalue() == "abc"
    crlf = _migration()
    framed = _event("a").replace(b"\n\n", b"\r\n\r\n")
    out = [crlf.feed(framed[i : i + 1]) for i in range(len(framed))]
    assert b"".join(out) == framed and not crlf.parsing and crlf.refused == "framing"


def test_a_continuation_splices_the_clients_messages_without_decoding_them() -> None:
    """A chat of 200,000 messages (a 16 MB body) is continued by splicing the text after the
    client's messages as they came (decoding and re-encoding them held the event loop for
    ~150 ms at the failure): spacing and number forms inside them are kept byte for byte."""
    messages = b'[{"role": "user",  "content": "hi", "x": 1.50}' + b', {"role":"user"}' * 200_000
    origin = b'{"model":"m","stream":true,"max_tokens":50,"messages":' + messages + b"]}"
    forward: Any = SimpleNamespace(status=200, target=None, model=None, origin=origin)
    migration = Migration(forward, True, 1, None)
    migration.feed(_event("Hello") + _event(" there"))
    body = migration._continuation()
    assert body is not None and messages in body
    decoded = json.loads(body)
    assert decoded["messages"][-1] == {"role": "assistant", "content": "Hello there"}
    assert len(decoded["messages"]) == 200_002
    assert decoded["continue_final_message"] is True
    assert decoded["add_generation_prompt"] is False and decoded["max_tokens"] == 48


def test_a_continuation_of_the_clients_own_continuation_extends_its_last_message() -> None:
    origin = json.dumps({"model": "m", "stream": True, "continue_final_message": True,
                         "messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "Once"}]}).encode()  # fmt: skip
    forward: Any = SimpleNamespace(status=200, target=None, model=None, origin=origin)
    migration = Migration(forward, True, 1, None)
    migration.feed(_event(" upon"))
    body = migration._continuation()
    assert body is not None
    assert json.loads(body)["messages"] == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}
    ]  # fmt: skip


def test_a_completion_continuation_appends_to_the_prompt() -> None:
    for prompt, continued in (("Once", "Once upon"), (["Once"], ["Once upon"])):
        origin = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 5}).encode()
        forward: Any = SimpleNamespace(status=200, target=None, model=None, origin=origin)
        migration = Migration(forward, False, 1, None)
        migration.feed(b'data: {"id":"c","created":1,"choices":[{"text":" upon"}]}\n\n')
        body = migration._continuation()
        assert body is not None
        assert json.loads(body) == {"model": "m", "prompt": continued, "max_tokens": 4}


def test_a_continuation_spliced_as_text_is_the_json_of_the_continued_request() -> None:
    """The splice joins JSON text (strings with escapes, arrays spaced any way) and decodes
    nothing: what it makes is the same request as one decoded, continued and encoded."""
    text = 'é "q" \\ \n'
    cases: list[tuple[bool, dict[str, Any]]] = [
        (True, {"messages": []}),
        (True, {"messages": [{"role": "user", "content": 'a "b"\\'}]}),
        (True, {"continue_final_message": True, "messages": [{"role": "assistant", "content": "x"}]}),
        (True, {"continue_final_message": True, "messages": [{"role": "user", "content": "x"}]}),
        (False, {"prompt": 'say "\\u00e9'}),
        (False, {"prompt": ["é\\"]}),
    ]  # fmt: skip
    for chat, request in cases:
        for indent in (None, 3):
            origin = json.dumps({"model": "m", **request, "max_tokens": 5}, indent=indent)
            forward: Any = SimpleNamespace(status=200, target=None, model=None)
            forward.origin = origin.encode() + b" " * 100
            migration = Migration(forward, chat, 1, None)
            piece = {"delta": {"content": text}} if chat else {"text": text}
            chunk = {"id": "c", "created": 1, "choices": [piece]}
            migration.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            body = migration._continuation()
            assert body is not None, request
            expected = json.loads(origin)
            expected["max_tokens"] = 4
            if not chat:
                prompt = expected["prompt"]
                expected["prompt"] = (
                    prompt + text if isinstance(prompt, str) else [prompt[0] + text]
                )
            else:
                expected["continue_final_message"], expected["add_generation_prompt"] = True, False
                messages = expected["messages"]
                if request.get("continue_final_message") and messages[-1]["role"] == "assistant":
                    messages[-1]["content"] += text
                else:
                    messages.append({"role": "assistant", "content": text})
            assert json.loads(body) == expected, (request, indent)
