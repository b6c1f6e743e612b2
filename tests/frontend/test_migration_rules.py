"""What a stream that may migrate reads of SSE as engines and proxies frame it, and when it
is not continued: each rule on a `Migration` over a stand-in forward (the splice itself is
tested end to end in test_migration_splice.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.frontend.proxy import continuation
from shoal.frontend.proxy import migration as migration_module
from shoal.frontend.proxy.continuation import refusal
from shoal.frontend.proxy.migration import Migration

CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":50,"stream":true}'


class _Counter:
    def labels(self, **_: Any) -> _Counter:
        return self

    def inc(self, *_: Any) -> None:
        pass

    observe = inc


def _migration(origin: bytes = CHAT, chat: bool = True) -> Migration:
    """A migration whose `resume` records the continuation body it would send."""
    sent: list[bytes] = []
    counter = _Counter()
    forward: Any = SimpleNamespace(
        status=200, target=None, model=None, origin=origin, body=origin, name="m", tried=[],
        prompt=None, sent=sent, request=SimpleNamespace(header=lambda _: None),
        proxy=SimpleNamespace(
            router=SimpleNamespace(pick=lambda *_: SimpleNamespace(instance_id=11)),
            metrics=SimpleNamespace(
                migrations=counter, migration_splice=counter, instances_inhibited=counter
            ),
            retries=2, inhibit_seconds=1.0,
        ),
    )  # fmt: skip
    forward.launch = lambda _: sent.append(forward.body)
    forward.end = sent.append  # (the end the gateway writes itself)
    return Migration(forward, chat, 3, None)


def _event(content: str | None = None, finish: str | None = None, **chunk: Any) -> bytes:
    delta = {} if content is None else {"content": content}
    chunk.setdefault("choices", [{"index": 0, "delta": delta, "finish_reason": finish}])
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _resumed(migration: Migration) -> bytes | None:
    failed = SimpleNamespace(instance_id=10, inhibit=lambda _: None)
    migration.ws = object()  # type: ignore[assignment]  # (the set `_find_set` finds)
    if not migration.resume(Exception("lost"), failed):  # type: ignore[arg-type]
        return None
    return migration.forward.sent[-1]  # type: ignore[attr-defined, no-any-return]


def test_the_id_kept_is_the_first_chunk_that_has_one_in_a_batch_as_one_by_one() -> None:
    stream = _event("") + _event("Once", id="c-1", created=111) + _event(" upon", id="c-2")
    batch, single = _migration(), _migration()
    batch.feed(stream)
    batch.catch_up()
    for event in stream.split(b"\n\n")[:-1]:
        single._read(event)
    assert (batch.id, batch.created) == (single.id, single.created) == ("c-1", 111)


def test_events_after_a_blank_line_or_with_other_fields_are_read() -> None:
    """SSE lets a `data:` line follow `event:`, `id:` or a comment, and events be apart by
    more than one blank line: each was skipped (its text left out of the continuation)."""
    stream = (
        _event("Once", id="c")
        + b"\n"  # (`\n\n\n`: an empty line more)
        + _event(" upon")
        + b"event: message\nid: 7\n: note\n"
        + _event(" a")
        + b'data: {"choices":\ndata: [{"delta": {"content": " time"}}]}\n\n'
    )
    for size in (len(stream), 1, 7):
        migration = _migration()
        out = [migration.feed(stream[i : i + size]) for i in range(0, len(stream), size)]
        migration.catch_up()
        assert b"".join(out) == stream
        assert migration.text.getvalue() == "Once upon a time" and migration.tokens == 4
        assert migration.refused is None


def test_a_stream_after_its_done_is_not_continued() -> None:
    migration = _migration()
    migration.feed(_event("Once", id="c") + b"data: [DONE]\n\n")
    assert _resumed(migration) is None
    assert migration.refused is None and migration.done  # (the reason counted: finished)


def test_a_stream_framed_with_a_bare_cr_passes_through_unread() -> None:
    """Events ending `\\r\\r` (legal SSE) hold no `\\n\\n`: all of them were held, the client got
    nothing, and at the end the request was sent again from the start."""
    stream = b'data: {"id":"c","choices":[{"delta":{"content":"Once"}}]}\r\r' * 3
    migration = _migration()
    assert migration.feed(stream) == stream
    assert not migration.parsing and migration.refused == "framing"


def test_a_continuation_event_with_a_number_out_of_range_is_rewritten_keeping_it_as_it_came() -> (
    None
):
    migration = _migration()
    migration.feed(_event("Once", id="c", created=1))
    assert _resumed(migration) is not None
    event = b'data: {"id":"x","x":1e400,"choices":[{"delta":{"content":" upon"}}]}\n\n'
    assert migration.feed(event) == (  # (members other than id, created, usage: as they came)
        b'data: {"id":"c","x":1e400,"choices":[{"delta":{"content":" upon"}}],"created":1}\n\n'
    )
    assert migration.text.getvalue() == "Once upon"


def test_a_continuation_event_of_thousands_of_choices_is_rewritten_reading_them_once() -> None:
    """Its members are taken as they came, not decoded again into objects and encoded (a
    2.7 MB event of 40,000 choices held the event loop ~75 ms, now ~25)."""
    migration = _migration()
    migration.feed(_event("Once", id="c", created=1))
    assert _resumed(migration) is not None
    choices = b",".join(b'{"index":%d,"delta":{"content":"x"},"logprobs":{"a":[1.50]}}' % i
                        for i in range(3))  # fmt: skip
    event = b'data: {"id":"x","created":9,"choices":[%s]}\n\n' % choices
    assert migration.feed(event) == b'data: {"id":"c","created":1,"choices":[%s]}\n\n' % choices
    assert migration.text.getvalue() == "Oncexxx"


def test_logprobs_of_zero_is_asked_for_and_refuses_migration() -> None:
    for value in (b"0", b"1", b"true", b"5"):
        assert refusal({"logprobs": value, "prompt": b'"x"'}, False) == "logprobs"  # type: ignore[dict-item]
    assert refusal({"logprobs": b"false"}, True) is None  # type: ignore[dict-item]
    assert refusal({"logprobs": b"null"}, True) is None  # type: ignore[dict-item]


def test_a_continuation_reduces_max_tokens_written_as_a_float() -> None:
    for written in (b"10.0", b"1e1"):
        origin = CHAT.replace(b'"max_tokens":50', b'"max_tokens":' + written)
        body = continuation.body(origin, None, True, "Once", 4)
        assert body is not None and json.loads(body)["max_tokens"] == 6


def test_continue_final_message_is_read_as_engines_read_a_boolean() -> None:
    for flag in (b"true", b"1", b'"true"', b'"yes"'):
        origin = (
            b'{"model":"m","continue_final_message":' + flag + b',"messages":'
            b'[{"role":"user","content":"hi"},{"role":"assistant","content":"Once"}]}'
        )
        body = continuation.body(origin, None, True, " upon", 1)
        assert body is not None
        assert json.loads(body)["messages"][-1] == {"role": "assistant", "content": "Once upon"}


def test_a_long_chat_continuing_its_own_last_message_is_refused_not_decoded_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """200,000 messages decoded and joined again to extend the last: 40-65 ms of the event
    loop at the failure. Past `MAX_DECODED` bytes that stream does not migrate."""

    def decoded(_: Any) -> list[Any]:
        raise AssertionError("the messages were decoded")

    monkeypatch.setattr(continuation, "_decode_list", decoded)
    messages = b'[{"role":"user","content":"hi"}' + b',{"role":"user","content":"x"}' * 200_000
    origin = (
        b'{"model":"m","continue_final_message":true,"messages":'
        + messages
        + b',{"role":"assistant","content":"Once"}]}'
    )
    assert continuation.body(origin, None, True, " upon", 1) is None


def test_the_body_is_read_at_the_first_failure_not_for_every_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every stream of a fleet of two or more decoded its whole body a second time for what
    it asked (`n`, `logprobs`, ...), though most never fail: 10 ms of the event loop for a
    10 MB chat. It is read when a failure needs it, and still refuses what it must."""
    reads: list[bytes] = []
    decode = migration_module._decode_members
    monkeypatch.setattr(
        migration_module, "_decode_members", lambda body: reads.append(body) or decode(body)
    )
    stream = _event("Once", id="c") + _event(" upon", finish="stop") + b"data: [DONE]\n\n"
    whole = _migration()
    whole.feed(stream)
    assert whole.complete() and reads == []
    asks_two = CHAT.replace(b'"stream":true', b'"stream":true,"n":2')
    failed = _migration(asks_two)
    failed.feed(_event("Once", id="c"))
    assert _resumed(failed) is None and failed.refused == "n"
    assert reads == [asks_two]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_a_stream_of_reasoning_is_not_continued(field: str) -> None:
    """A reasoning parser's deltas are no text of the message: a continuation would think
    again from nothing, or repeat the reasoning the client had (read one by one and in
    batches alike)."""
    reasoning = {"choices": [{"index": 0, "delta": {field: "Let me think"}}]}
    for batched in (False, True):
        migration = _migration()
        migration.feed(_event("", id="c", created=1) + _event(**reasoning))
        if batched:
            migration.catch_up()
        assert _resumed(migration) is None
        assert migration.refused == "reasoning"


@pytest.mark.parametrize(
    ("member", "value", "refused"),
    [
        ("response_format", {"type": "json_object"}, "structured"),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}, "structured"),
        ("response_format", {"type": "text"}, None),
        ("guided_json", {"type": "object"}, "structured"),
        ("guided_choice", ["a", "b"], "structured"),
        ("structured_outputs", {"regex": "a+"}, "structured"),
        ("guided_json", None, None),
    ],
)
def test_a_stream_the_engine_constrains_from_its_start_is_not_continued(
    member: str, value: Any, refused: str | None
) -> None:
    """A grammar is applied again from its root to a continuation: a second JSON document
    would begin after the half-sent one."""
    members = {"messages": b"[]", member: json.dumps(value).encode()}
    assert refusal(members, True) == refused  # type: ignore[arg-type]


def test_a_continuation_asks_for_min_tokens_less_the_tokens_sent() -> None:
    body = b'{"messages":[],"max_tokens":20,"min_tokens":8}'
    sent = json.loads(continuation.body(body, None, True, "abc", 5) or b"")
    assert (sent["max_tokens"], sent["min_tokens"]) == (15, 3)
    sent = json.loads(continuation.body(body, None, True, "abc", 12) or b"")
    assert (sent["max_tokens"], sent["min_tokens"]) == (8, 0)


def test_a_continuation_asks_max_tokens_less_the_tokens_the_usage_counts_not_the_chunks() -> None:
    """An engine may put several tokens in a chunk (`--stream-interval`): two chunks of
    three tokens, their usage counting them (`continuous_usage_stats`), leave 50 - 6, not
    50 - 2. At a second failure the continuation's usage counts its own tokens, after the
    6 its prompt carried."""

    def usage(tokens: int) -> dict[str, int]:
        return {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": 4 + tokens}

    migration = _migration()
    migration.feed(_event("a b c", id="c", created=1, usage=usage(3)))
    migration.feed(_event(" d e f", usage=usage(6)))
    assert json.loads(_resumed(migration) or b"")["max_tokens"] == 44
    out = migration.feed(_event(" g h", usage=usage(2)))
    assert json.loads(out[len(b"data: ") :])["usage"]["completion_tokens"] == 8
    assert json.loads(_resumed(migration) or b"")["max_tokens"] == 42


def test_a_completion_that_named_no_max_tokens_continues_within_the_engines_default() -> None:
    """Engines give a completion 16 tokens when it names none: the continuation, sent without
    one too, got 16 more."""
    sent = json.loads(continuation.body(b'{"prompt":"Once"}', None, False, " upon", 10) or b"")
    assert sent["max_tokens"] == continuation.COMPLETION_DEFAULT - 10
    chat = json.loads(continuation.body(b'{"messages":[]}', None, True, "x", 10) or b"")
    assert "max_tokens" not in chat  # (a chat's default is the context's rest)


@pytest.mark.parametrize(
    "delta",
    [{"role": "assistant", "content": " upon"}, {"role": "assistant", "content": ""}],
)
def test_a_continuations_role_never_reaches_the_client_whatever_comes_with_it(
    delta: dict[str, str],
) -> None:
    migration = _migration()
    migration.feed(_event("Once", id="c", created=1))
    assert _resumed(migration) is not None
    usage = {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}  # (continuous)
    event = b"data: " + json.dumps({"id": "x", "created": 9, "usage": usage,
                                    "choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n"  # fmt: skip
    out = migration.feed(event)
    assert b'"role"' not in out
    sent = json.loads(out[len(b"data: ") :])
    assert sent["choices"][0]["delta"] == {"content": delta["content"]}
    assert sent["usage"]["completion_tokens"] == 1  # (the token carried, counted)


def test_the_end_written_at_max_tokens_counts_the_prompt_the_stream_carried() -> None:
    """A stream with continuous usage (vLLM's `continuous_usage_stats`) that dies at its
    `max_tokens` is ended by the gateway: its usage chunk has the prompt's tokens the
    engine counted, not an estimate."""
    body = b'{"messages":[],"max_tokens":2,"stream":true,"stream_options":{"include_usage":1}}'
    migration = _migration(body)
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    migration.feed(_event("a", id="c", created=5, model="m") + _event("b", usage=usage))
    ended = _resumed(migration) or b""
    events = [json.loads(e[len(b"data: ") :]) for e in ended.split(b"\n\n")[:-2]]
    assert ended.endswith(b"data: [DONE]\n\n")
    assert [e["choices"] for e in events] == [
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}],
        [],
    ]
    assert events[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    assert {(e["id"], e["created"], e["model"]) for e in events} == {("c", 5, "m")}


@given(st.text("abE", max_size=12), st.lists(st.text("abE", min_size=1, max_size=6), max_size=3))
def test_a_stop_string_cut_at_the_splice_is_found_whatever_its_repeats(
    text: str, stops: list[str]
) -> None:
    """`halt` says "stop" exactly when the text ends with a proper prefix of a stop string
    (the first characters it finds in the text's end are checked, not every length)."""
    members = {"stop": msgspec.Raw(json.dumps(stops).encode())}
    cut = any(text.endswith(s[:k]) for s in stops for k in range(1, len(s)) if text)
    assert (continuation.halt(members, True, text, 0) == "stop") == cut


def test_a_stop_member_too_long_to_compare_refuses_migration() -> None:
    """A `stop` over `MAX_STOP` bytes is not compared character by character (a string of
    one repeated character made that quadratic): the stream is not continued."""
    stop = msgspec.Raw(json.dumps(["a" * continuation.MAX_STOP]).encode())
    assert continuation.halt({"stop": stop}, True, "b", 0) == "stop"
    assert continuation.halt({"stop": msgspec.Raw(b'"ab"')}, True, "b", 0) is None
