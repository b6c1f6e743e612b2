"""`Controller`, `Heartbeat` and `HeartbeatMixin`: a control loop's unit of work and its liveness.

Liveness follows progress, not steps. A step that takes longer than the deadline (400
items at 100 ms each) is healthy as long as it keeps reporting progress; a step that
stops reporting is not, however recently it began.

The rule: a beat only ever follows completed work. Never beat from a timer, and never
around a call that might block: a single call that hangs forever must stop the clock,
so that it is caught. Slow-but-advancing work is healthy; that is the point.

A call to something outside the process that every replica shares (the store) is marked
with `waiting_on`: the time spent in it is not this loop's silence. While it lasts, a
silence is reported as that wait, which no readiness probe fails for (another replica would
wait just the same), and the clock starts again when it ends.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager


class Controller(abc.ABC):
    """One unit of reconciliation, run over and over by a `Loop`.

    `step()` is either `async def` (run in the event loop) or a plain method (run in the
    loop's own thread). A controller that knows it cannot do its job says so in `is_healthy`.
    """

    @abc.abstractmethod
    def step(self) -> Awaitable[None] | None:
        """Do one pass of work: observe, compare, act."""

    @property
    def is_healthy(self) -> bool:
        """False when the controller knows it cannot do its job; probed by readiness checks."""
        return True


class Heartbeat:
    """The time of the last observed progress, on a monotonic clock.

    `beat()` is a single float assignment, so it is safe to call from the loop's thread
    while the event loop reads `silence()`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last = clock()
        self.waiting: str | None = None  # the shared dependency a step waits on now

    def beat(self) -> None:
        """Record that work was just completed."""
        self.last = self.clock()

    def silence(self) -> float:
        """Seconds since the last beat."""
        return self.clock() - self.last

    @contextlib.contextmanager
    def waiting_on(self, what: str) -> Iterator[None]:
        """The work inside waits on `what`, outside the process and shared by every replica.
        A silence meanwhile is reported as this wait; when it ends (answered or failed), the
        silence is counted from then: the wait was not this loop's own work."""
        self.waiting = what
        try:
            yield
        finally:
            self.waiting = None
            self.last = max(self.last, self.clock())


class HeartbeatMixin:
    """Gives a controller `emit_heartbeat()`, to call after each completed piece of work.

    It does nothing until a `Loop` attaches a heartbeat. Pass the bound `emit_heartbeat`
    (a `Callable[[], None]`) to the helpers a step calls, not the `Heartbeat`, so they
    report progress without knowing how liveness is measured. Call it after an item is
    done, never before a call that might block: a hang must stop the clock.
    """

    _heartbeat: Heartbeat | None = None

    def attach_heartbeat(self, heartbeat: Heartbeat | None) -> None:
        """Route `emit_heartbeat()` to `heartbeat` (None detaches)."""
        self._heartbeat = heartbeat

    def emit_heartbeat(self) -> None:
        """Report that a piece of work was just completed."""
        if self._heartbeat is not None:
            self._heartbeat.beat()

    def waiting_on(self, what: str) -> AbstractContextManager[None]:
        """Mark a call to a shared dependency (`Heartbeat.waiting_on`); pass it to helpers
        like `emit_heartbeat`."""
        if self._heartbeat is None:
            return contextlib.nullcontext()
        return self._heartbeat.waiting_on(what)
