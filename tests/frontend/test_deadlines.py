"""The one sweep that enforces every attempt's first-byte and idle timeouts (deadlines.py)."""

from __future__ import annotations

import asyncio

import pytest

from shoal.frontend.proxy.deadlines import MAX_SWEEP, MIN_SWEEP, Deadlines
from tests.helpers import wait_for


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
    await asyncio.sleep(0.05)
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
