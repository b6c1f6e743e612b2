"""`Deadlines`: the first-byte and idle timeouts of every attempt in flight, enforced by one
periodic timer (a sweep) rather than a timer per request.

A timer per request costs a timer handle made, queued and cancelled for every request, and a
clock read for every packet of a stream; the sweep costs a set insertion and removal per
attempt, and one clock read per sweep for all of them. What it costs in precision: each sweep
checks every attempt it watches against the time it reads, every `every` seconds (a tenth of
the shortest timeout, between `MIN_SWEEP` and `MAX_SWEEP`), so a deadline is late by at most
one sweep for the first byte (the attempt's start is read from the clock) and two for the
idle timeout (a packet's arrival is dated by the next sweep, not read per packet); never early.
With the defaults (60 s each) a stuck instance is left within 60-61 s, a silent one within
60-62 s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

log = logging.getLogger(__name__)

MIN_SWEEP = 0.01  # seconds between sweeps, at least (timeouts of a few tenths, in tests)
MAX_SWEEP = 1.0  # and at most (the defaults: 60 s)
TURN_SECONDS = 0.005  # a sweep's slice: then the loop turns (failing 1,000 at once took 43 ms)


class Watched(Protocol):
    """An attempt in flight, as the sweep sees it (`Forward`)."""

    def check_deadline(self, now: float) -> None:
        """Fail the attempt if it is past a deadline at `now` (`time.perf_counter()`)."""
        ...


class Deadlines:
    """The attempts in flight with a deadline, and the one timer that checks them.

    Invariant: while `watched` is not empty a sweep is scheduled; it stops itself at the
    first sweep that finds nothing to watch, and `watch` starts it again.
    """

    def __init__(self, *timeouts: float) -> None:
        shortest = min((t for t in timeouts if t > 0), default=MAX_SWEEP * 10)
        self.every = min(max(shortest / 10, MIN_SWEEP), MAX_SWEEP)
        self.watched: set[Watched] = set()
        self.unwatch = self.watched.discard  # (an attempt that ends: one call, no lookup)
        self._timer: asyncio.Handle | None = None  # the next sweep, or the rest of this one

    def watch(self, attempt: Watched) -> None:
        """Check `attempt` at each sweep from now on, until `unwatch(attempt)`."""
        self.watched.add(attempt)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.every, self._sweep)

    def _sweep(self) -> None:
        self._check(list(self.watched), time.perf_counter())

    def _check(self, attempts: list[Watched], now: float) -> None:
        """Check `attempts` (those watched at the sweep of `now`); one that fails its check
        affects only itself. Past `TURN_SECONDS`, the rest in the loop's next turn."""
        watched = self.watched
        began = time.perf_counter()
        for i, attempt in enumerate(attempts):
            if attempt in watched:  # (not ended since)
                try:
                    attempt.check_deadline(now)
                except Exception:
                    log.exception("checking the deadline of %r failed", attempt)
                    watched.discard(attempt)
            if i & 31 == 31 and time.perf_counter() - began > TURN_SECONDS:
                # (the sweep goes on: `watch` starts no other meanwhile)
                self._timer = asyncio.get_running_loop().call_soon(
                    self._check, attempts[i + 1 :], now
                )
                return
        if watched:
            self._timer = asyncio.get_running_loop().call_later(self.every, self._sweep)
        else:
            self._timer = None

    def close(self) -> None:
        """Stop sweeping (the frontend stops): the pending timer holds this object, and this
        object the timer, a reference cycle that outlives a stopped frontend otherwise."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.watched.clear()
