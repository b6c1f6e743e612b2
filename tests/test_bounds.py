"""`shoal.bounds`: the one nesting-depth rule, checked on raw JSON before any decoder."""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal import bounds
from shoal.bounds import MAX_DEPTH, DepthMeter, TooDeep, check_json_depth, json_depth_exceeds


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


def nested(depth: int, kind: str = "list") -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n'),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet='[]{}"\\ab', max_size=3), inner, max_size=3)
    ),
    max_leaves=40,
)


@given(json_values, st.integers(min_value=0, max_value=12))
def test_depth_check_agrees_with_the_parsed_depth_of_any_value(value: Any, limit: int) -> None:
    assert json_depth_exceeds(json.dumps(value).encode(), limit) == (depth_of(value) > limit)


def metered(text: bytes, cuts: list[int], limit: int) -> bool:
    meter = DepthMeter(limit)
    exceeded = False
    start = 0
    for cut in [*sorted({min(c, len(text)) for c in cuts}), len(text)]:
        exceeded = meter.feed(text[start:cut])
        start = cut
    return exceeded


@given(
    json_values,
    st.integers(min_value=0, max_value=12),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_depth_judged_in_pieces_agrees_with_the_whole_text_wherever_it_is_cut(
    value: Any, limit: int, cuts: list[int]
) -> None:
    text = json.dumps(value).encode()
    assert (
        metered(text, cuts, limit) == json_depth_exceeds(text, limit) == (depth_of(value) > limit)
    )


@given(st.text(alphabet='[]{}"\\a', max_size=80), st.lists(st.integers(0, 80), max_size=8))
def test_depth_judged_in_pieces_of_any_text_agrees_with_the_whole_text(
    text: str, cuts: list[int]
) -> None:
    """Not JSON too: the same verdict as the whole-text check wherever that one is exact
    (no stray closer: after one, a decoder stops and depth no longer matters; nothing left
    open: the whole-text check may judge an opener never closed deeper than it is)."""
    raw = text.encode()
    stripped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(stripped.split(b'"')[::2]).translate(bytes.maketrans(b"{}", b"[]"))
    depth, deepest, stray = 0, 0, False
    for byte in outside:
        if byte == ord("["):
            depth += 1
            deepest = max(deepest, depth) if not stray else deepest
        elif byte == ord("]"):
            stray = stray or depth == 0
            depth -= 1
    if not stray:  # (exact: the deepest point, whatever is left open at the end)
        assert metered(raw, cuts, 3) == (deepest > 3)
        if depth == 0 and stripped.count(b'"') % 2 == 0:
            assert metered(raw, cuts, 3) == json_depth_exceeds(raw, 3)


def test_a_chat_fed_as_a_socket_delivers_it_is_judged_a_piece_at_a_time() -> None:
    message = {"role": "user", "content": 'a "quoted" \\ [bracket] {brace}\n' * 8}
    body = json.dumps({"model": "m", "messages": [message] * 20_000}).encode()
    deep = body[:-2] + b"," + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + body[-2:]
    for text, expected in ((body, False), (deep, True)):
        meter = DepthMeter()
        verdicts = [meter.feed(text[i : i + 65536]) for i in range(0, len(text), 65536)]
        assert verdicts[-1] is expected and json_depth_exceeds(text) is expected
        if not expected:  # (all read: nothing open, nothing carried)
            assert meter.depth == 0 and not meter.in_string and meter.carry == b""


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_a_value_at_the_bound_passes_and_one_level_more_is_refused(kind: str) -> None:
    check_json_depth(json.dumps(nested(MAX_DEPTH, kind)))
    with pytest.raises(TooDeep, match=f"deeper than {MAX_DEPTH} levels"):
        check_json_depth(json.dumps(nested(MAX_DEPTH + 1, kind)))


def test_brackets_inside_strings_do_not_count() -> None:
    value = {"prompt": "[" * 5000 + '\\"{' * 100, "k": ['"]]]"']}
    assert not json_depth_exceeds(json.dumps(value))


def test_a_thousand_levels_are_refused_without_recursion() -> None:
    assert json_depth_exceeds(b"[" * 100_000 + b"]" * 100_000)
    assert json_depth_exceeds(b'{"a":' * 1000)  # truncated input is judged too


def peeled_exceeds(brackets: bytes, limit: int) -> bool:
    """Whether `brackets` nests deeper than `limit`, peeled a level a pass to the end: the
    reference the check must agree with, on any brackets, balanced or not."""
    for level in range(limit + 1):
        if b"[" * (limit - level + 1) in brackets:
            return True
        brackets = brackets.replace(b"[]", b"")
        if b"[" not in brackets:
            return False
    return True


def reference_exceeds(data: bytes, limit: int) -> bool:
    """The check as it was before it became one match (escapes dropped, the pieces between
    quotes left out, then peeled a level a pass): what it says of any text, JSON or not,
    the check says too."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    raw = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = raw.translate(bytes.maketrans(b"{}", b"[]"), bytes(set(range(256)) - set(b'"[]{}')))
    return peeled_exceeds(b"".join(structure.split(b'"')[::2]), limit)


HOSTILE = [b"[", b"]", b"{", b"}", b'"', b"\\", b'\\"', b"\\\\", b'"["', b'"]"', b"[" * 9, b"]" * 9]


@given(
    st.lists(st.sampled_from([*HOSTILE, b"a", b",", b":"]), max_size=80)
    | st.binary(max_size=120)
    | st.text(alphabet='[]{}"\\a', max_size=120).map(str.encode),
    st.integers(min_value=0, max_value=20),
)
def test_depth_check_agrees_with_the_pass_a_level_check_on_any_text(
    text: list[bytes] | bytes, limit: int
) -> None:
    """Escapes, brackets in strings, strings never closed, stray closers, openers never
    closed: on each, the one match says what peeling a level a pass said."""
    data = b"".join(text) if isinstance(text, list) else text
    assert json_depth_exceeds(data, limit) == reference_exceeds(data, limit)


@given(st.text(alphabet="[]", max_size=200), st.integers(min_value=0, max_value=70))
def test_brackets_are_judged_as_peeled_to_the_end(text: str, limit: int) -> None:
    brackets = text.encode()
    assert bounds._nests_deeper(brackets, limit) == peeled_exceeds(brackets, limit)


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "left open"])
def test_brackets_hundreds_of_levels_deep_are_judged_as_peeled(closed: bool) -> None:
    chain = (b"[" + b"[[[[[]]]]]") * 300 + b"]" * (300 if closed else 0)
    for brackets in (chain, b"]" + chain, chain + b"]]", b"[" * 400 + b"]" * 400):
        for limit in (64, 254, 255):
            assert bounds._nests_deeper(brackets, limit) == peeled_exceeds(brackets, limit)


def test_a_bound_deeper_than_the_check_takes_is_refused_by_name() -> None:
    for check in (lambda: json_depth_exceeds(b"[]", 256), lambda: DepthMeter(256)):
        with pytest.raises(ValueError, match="at most 255"):
            check()


MIB = 1 << 20
NEST = b"[" * 60 + b"]" * 60


@pytest.mark.parametrize(
    "value",
    [
        b"[" + b",".join([NEST] * (MIB // 121)) + b"]",
        b"]" + b",".join([NEST] * (MIB // 121)),
        b"[" + b",".join([b'["[",' * 30 + b'"]"' + b"]" * 30] * (MIB // 190)) + b"]",
    ],
    ids=["nests 60 deep", "a stray closer, then nests", "strings of brackets in nests"],
)
def test_a_store_value_is_checked_within_the_event_loops_budget(value: bytes) -> None:
    """Values of 1 MiB (the store's bound) are checked on the event loop before they are
    decoded (cards, instances, routes, grants). Peeled a level a pass, 1 MiB of arrays 60
    deep held it ~35 ms, ~150 ms after a stray closer (no running depth then), and strings
    holding brackets, split at every quote, ~14 ms; one match: ~8 ms. Best of 3, in this
    thread's CPU time (not another process's)."""
    assert len(value) <= MIB
    best = 1.0
    for _ in range(3):
        started = time.thread_time()
        assert not json_depth_exceeds(value)
        best = min(best, time.thread_time() - started)
    assert best < 0.020, f"{best * 1000:.1f} ms for {len(value):,} bytes"


def allocated(work: Callable[[], object]) -> int:
    """The most memory `work` held at once beyond what was held before (`tracemalloc`)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        work()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_a_chat_of_many_messages_is_checked_without_an_object_per_quote() -> None:
    """The check runs on the event loop before every request body is decoded: splitting at
    each of 1.6 million quotes held the loop ~0.8 s for an 8 MB chat, four times msgspec's
    own decoding of it. Counted in memory, not timed: a few passes over the body's bytes
    hold one copy of it at most, where a piece per quote held ten times the body."""
    message = {"role": "user", "content": "hi there"}
    body = json.dumps({"model": "m", "messages": [message] * 200_000}).encode()
    check = allocated(lambda: json_depth_exceeds(body))
    assert check <= len(body) + 4096, f"{check} bytes held to check {len(body)}"
    assert check < allocated(lambda: msgspec.json.decode(body)) / 4
