"""Model names over a whole fleet, sorted and listed a slice at a time on the event loop.

`/metrics` writes each family in the order of its model names; at 30,000 models, sorting
them in one piece held the loop 11 ms (100,000: 83 ms), a cost that grows faster than the
fleet. `sorted_in_steps` sorts runs of `SORT_SLICE` names in C, a run per turn, then merges
them a `SORT_SLICE` at a time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Generator, Mapping

SORT_SLICE = 1024
"""Names sorted, merged or looked up between two yields to the event loop (a run of them
sorted: a fraction of a millisecond)."""


def sorted_in_steps(names: list[str], step: int = SORT_SLICE) -> Generator[None, None, list[str]]:
    """`sorted(set(names))`, a step (a yield) per `step` names: runs of `step` names sorted
    in C, then merged `step` names at a time. At most `step` names: at once, no step."""
    if len(names) <= step:
        return sorted(set(names))
    runs = []
    for start in range(0, len(names), step):
        runs.append(sorted(names[start : start + step]))
        yield
    merged, out = heapq.merge(*runs), list[str]()
    for _ in range(0, len(names), step):
        piece = list(dict.fromkeys(itertools.islice(merged, step)))  # (a name twice: adjacent)
        out += piece[1:] if out and piece and piece[0] == out[-1] else piece
        yield
    return out


def live_names(present: Mapping[str, int]) -> list[str]:
    """The names of `present`, copied in one piece in C: its `names()` if it has one (the
    frontend's: its tables' keys, where a name in both is listed twice), else its keys."""
    names: Callable[[], list[str]] | None = getattr(present, "names", None)
    return list(present) if names is None else names()
