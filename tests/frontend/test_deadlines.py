"""The one sweep that enforces every attempt's first-byte and idle timeouts (deadlines.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from shoal.frontend.proxy.deadlines import MAX_SWEEP, MIN_SWEEP, TURN_SECONDS, Deadlines
from tests.helpers import timers_due_within, wait_for


class Attempt:
    def __init__(self, deadlines: Deadlines, *, fails: bool = False) -> None:
        self.deadlines = deadlines
        self.checks: list[float] = []
        self.fails = fails

    def check_deadline(self, now: float) -> None:
        self.checks.append(now)
        if self.fails:
            raise RuntimeError("a bug in one attempt's check")


@pytest.mark.parametrize(
    ("timeouts", "every"),
    [((60.0, 60.0), MAX_SWEEP), ((0.3, 60.0), 0.03), ((0.0, 2.0), 0.2), ((0.05,), MIN_SWEEP)],
)
def test_the_sweep_runs_at_a_tenth_of_the_shortest_timeout_within_bounds(
    timeouts: tuple[float, ...], every: float
) -> None:
    assert Deadlines(*timeouts).every == pytest.approx(every)


async def test_the_sweep_runs_while_something_is_watched_and_stops_when_nothing_is() -> None:
    deadlines = Deadlines(0.1)
    attempt = Attempt(deadlines)
    deadlines.watch(attempt)
    await wait_for(lambda: len(attempt.checks) >= 3, message="swept")
    deadlines.unwatch(attempt)
    await wait_for(lambda: deadlines._timer is None, message="sweep stopped")
    checks = len(attempt.checks)
    await timers_due_within(2 * deadlines.every)  # (a sweep still due ran by then)
    assert len(attempt.checks) == checks
    deadlines.watch(attempt)  # and it starts again
    await wait_for(lambda: len(attempt.checks) > checks, message="swept again")


async def test_one_attempt_whose_check_fails_does_not_stop_the_others() -> None:
    deadlines = Deadlines(0.1)
    broken, sound = Attempt(deadlines, fails=True), Attempt(deadlines)
    deadlines.watch(broken)
    deadlines.watch(sound)
    await wait_for(lambda: len(sound.checks) >= 3, message="swept")
    assert len(broken.checks) == 1  # dropped after its failure
    assert deadlines.watched == {sound}


async def test_closed_deadlines_sweep_no_more_and_hold_no_timer() -> None:
    deadlines = Deadlines(0.1)
    attempt = Attempt(deadlines)
    deadlines.watch(attempt)
    await wait_for(lambda: len(attempt.checks) >= 1, message="swept")
    timer = deadlines._timer
    assert timer is not None
    deadlines.close()
    assert deadlines._timer is None and timer.cancelled()
    assert deadlines.watched == set()


async def test_a_sweep_with_many_attempts_to_fail_lets_the_event_loop_turn_between_slices() -> None:
    """Each attempt past its deadline is failed in its check (a log line, a retry's pick and
    connect): 1,000 at once held the loop ~43 ms. The sweep gives the loop a turn after each
    slice of `TURN_SECONDS`, so other connections are served meanwhile."""
    loop = asyncio.get_running_loop()
    turns = 0

    def tick() -> None:  # (one increment per turn of the loop)
        nonlocal turns
        turns += 1
        loop.call_soon(tick)

    seen: list[int] = []

    class Slow(Attempt):
        def check_deadline(self, now: float) -> None:
            super().check_deadline(now)
            seen.append(turns)
            self.deadlines.unwatch(self)  # (failed: no longer watched)
            end = time.perf_counter() + 0.0005  # (a failure's work: half a millisecond)
            while time.perf_counter() < end:
                pass

    deadlines = Deadlines(0.1)
    attempts = [Slow(deadlines) for _ in range(200)]  # 100 ms of work in all
    for attempt in attempts:
        deadlines.watch(attempt)
    loop.call_soon(tick)
    await wait_for(lambda: all(a.checks for a in attempts), message="all checked")
    per_turn = max(seen.count(t) for t in set(seen))
    assert per_turn <= TURN_SECONDS / 0.0005 + 32, per_turn  # (checked in steps of 32)
    assert len(set(seen)) >= 3
    assert all(len(a.checks) == 1 for a in attempts)  # each once: none lost, none twice
