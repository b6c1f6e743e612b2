"""`bounds.DepthMeter` at its edges: exact wherever a value is cut (escapes, UTF-8, strings
holding brackets, the bound itself), and a piece costs a few passes even just under the bound."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import pytest

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


def best_of(runs: int, work: Any) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.thread_time()
        work()
        best = min(best, time.thread_time() - started)
    return best


@pytest.mark.parametrize("piece", [8192, 1 << 22])
def test_meter_costs_a_few_passes_a_piece_even_just_under_the_bound(piece: int) -> None:
    """A value held at depth 63 whose pieces are full of closed pairs (`[],` ...): every
    piece is peeled (depth + openers > limit), and the closers appended to the piece are
    `depth + opens` (every opener of the piece, closed in it or not), so each of the 63
    peeling passes copies the whole tail of surplus closers again. The whole-text check
    of the same text makes one long pass and then peels 126 brackets."""
    text = b"[" * 63 + b"[]," * 1_000_000 + b"0" + b"]" * 63

    def meter() -> None:
        m = DepthMeter()
        for i in range(0, len(text), piece):
            assert not m.feed(text[i : i + piece])

    whole = best_of(5, lambda: json_depth_exceeds(text))  # (5: the least of a busy machine's)
    metered = best_of(5, meter)
    # (a few passes: 2-3.2 times the whole text's one pass, on quiet and busy machines alike;
    # the 63 passes of a quadratic peel were ~30 times)
    assert metered < 4 * whole, f"meter {metered * 1e3:.0f} ms, whole text {whole * 1e3:.0f} ms"
