"""Test support for the controllers tests: a fake clock and waiting on a condition with a deadline."""

from __future__ import annotations

from collections.abc import Callable

from tests.helpers import wait_for as shared_wait_for


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def wait_for(condition: Callable[[], object], what: str, timeout: float = 2.0) -> None:
    """Poll `condition` until it is truthy; fail the test naming `what` after `timeout` seconds."""
    await shared_wait_for(condition, timeout=timeout, interval=0.005, message=what)
