"""`bounds.DepthMeter` at its edges: exact wherever a value is cut (escapes, UTF-8, strings
holding brackets, the bound itself), and a piece costs a few passes even just under the bound."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from shoal import bounds
from shoal.bounds import MAX_DEPTH, DepthMeter, json_depth_exceeds
from tests.test_bounds import depth_of

TRICKY = ["\\", '"', "[", "]", "{", "}", "é", "\u005c", "\\u005c", '\\"', "\\\\", "€", "𝄞"]


def nested(levels: int, kind: str) -> Any:
    value: Any = 'x\\"]['
    for _ in range(levels):
        value = [value, "]]\\"] if kind == "list" else {'k"[\\': value, "s": "}{\\\\"}
    return value


@pytest.mark.parametrize("kind", ["list", "dict"])
@pytest.mark.parametrize("levels", [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1])
@pytest.mark.parametrize("ascii_only", [True, False])
def test_meter_at_the_bound_fed_byte_by_byte_and_in_odd_pieces(
    kind: str, levels: int, ascii_only: bool
) -> None:
    text = json.dumps(nested(levels, kind), ensure_ascii=ascii_only).encode()
    expected = levels > MAX_DEPTH
    assert json_depth_exceeds(text) is expected
    for size in (1, 2, 3, 7, 64):
        meter = DepthMeter()
        verdict = False
        for i in range(0, len(text), size):
            verdict = meter.feed(text[i : i + size])
            meter.feed(b"")  # empty pieces change nothing
        assert verdict is expected, size


def test_meter_agrees_with_the_whole_text_at_every_pair_of_cuts() -> None:
    values: list[Any] = [
        {"a": [s, [s, {"b": s}]]} for s in ("".join(p) for p in itertools.permutations(TRICKY, 3))
    ][:200]
    for value in values:
        text = json.dumps(value, ensure_ascii=False).encode()
        want = depth_of(value) > 2
        for i, j in itertools.combinations(range(0, len(text) + 1, 2), 2):
            meter = DepthMeter(2)
            meter.feed(text[:i])
            meter.feed(text[i:j])
            assert meter.feed(text[j:]) is want, (text, i, j)


@pytest.mark.parametrize("piece", [8192, 1 << 22])
def test_meter_matches_each_piece_once_even_just_under_the_bound(
    piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value held at depth 63 whose pieces are full of closed pairs (`[],` ...): every
    piece is matched (depth + openers > limit). Were the closers appended to a piece
    `depth + opens` (every opener of the piece, closed in it or not) instead of the openers
    left open, each piece would carry a tail of surplus closers as long as itself. Counted
    in bytes matched, not timed."""
    text = b"[" * 63 + b"[]," * 1_000_000 + b"0" + b"]" * 63
    matched: list[int] = []
    real = bounds._nests_deeper

    def counting(brackets: bytes, limit: int) -> bool:
        matched.append(len(brackets))
        return real(brackets, limit)

    monkeypatch.setattr(bounds, "_nests_deeper", counting)
    meter = DepthMeter()
    for i in range(0, len(text), piece):
        assert not meter.feed(text[i : i + piece])
    assert matched, "every piece over the bound is matched"
    assert sum(matched) < len(text), f"matched {sum(matched):,} bytes of a {len(text):,}-byte text"
