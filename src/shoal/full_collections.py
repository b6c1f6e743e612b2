"""Python's full garbage collections deferred, process-wide, while any holder asks.

The oldest generation's threshold is process-wide: a catalog pass (`shoal.catalog.collector`)
and a frontend's load (`shoal.frontend.registry.freeze`) each lift it while they build what a
full collection would go through for nothing. Each holder saving the thresholds it found and
putting them back when it ended left, when two overlapped and ended in the order they began,
the second's saved copy in force: the lifted threshold, no full collection for the life of
the process. Here the holders are counted: the first lifts the threshold, the last to end
puts back what the first found, in whatever order they end.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

DEFERRED = 2**30
"""The oldest generation's threshold while deferred: never reached."""

_holders = 0  # deferrals in force now, in this process
_saved: tuple[int, int, int] | None = None  # the thresholds the first of them found


def defer() -> None:
    """No full collection until the matching `resume()` (the first holder lifts it)."""
    global _holders, _saved
    if _holders == 0:
        _saved = gc.get_threshold()
        gc.set_threshold(_saved[0], _saved[1], DEFERRED)
    _holders += 1


def resume() -> None:
    """The end of one `defer()`: the last to end puts the thresholds back."""
    global _holders
    _holders -= 1
    if _holders == 0 and _saved is not None:
        gc.set_threshold(*_saved)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """No full collection starts inside (unless the thresholds are set meanwhile)."""
    defer()
    try:
        yield
    finally:
        resume()
