"""`Loop`: run a controller's `step()`, waiting `interval` after each, and report whether it is alive.

An `async def step()` runs in an asyncio task; a plain `step()` runs in a dedicated daemon
thread, so a blocking controller never stalls the event loop. A step that raises is logged
with its traceback once per distinct failure, and the loop goes on. A loop is healthy while
its task or thread is alive, it made progress within `max_silence`, its steps have not kept
failing for longer than `max_silence`, and its controller says it is healthy.

Two kinds of unhealthy, because they call for different answers: a loop *stuck* on its own
work (not running, silent, its controller says so) is this process's trouble, which taking
it out of traffic or restarting it may fix; a loop whose steps keep *failing*, or that is
silent while waiting on a shared dependency (`Heartbeat.waiting_on`: the store), is held up
by something every replica shares (`LoopHealth.failing`): reported, but it fails no
readiness probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shoal.controllers.heartbeat import Controller, Heartbeat, HeartbeatMixin

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopHealth:
    """The result of one health probe; `reason` says what is wrong when not `healthy`.

    `failing`: unhealthy only because its steps keep raising, or it is silent while waiting
    on a dependency every replica shares; otherwise an unhealthy loop is stuck on its own
    work."""

    healthy: bool
    reason: str | None = None
    failing: bool = False


class MonitoredController(Controller):
    """Owns a controller's heartbeat: attaches it, and beats on entering each step.

    Beating on entry means a controller that reports nothing is judged by how long a single
    step runs; one that calls `emit_heartbeat()` per item is judged by its slowest item.
    """

    def __init__(self, controller: Controller, heartbeat: Heartbeat | None = None) -> None:
        self.controller = controller
        self.heartbeat = heartbeat or Heartbeat()
        if isinstance(controller, HeartbeatMixin):
            controller.attach_heartbeat(self.heartbeat)

    @property
    def is_async(self) -> bool:
        """True if the wrapped `step` is `async def` and so runs in the event loop."""
        return inspect.iscoroutinefunction(self.controller.step)

    def step(self) -> Awaitable[None] | None:
        # The previous step and the sleep completed: that is progress.
        self.heartbeat.beat()
        return self.controller.step()

    @property
    def is_healthy(self) -> bool:
        return self.controller.is_healthy


@dataclass
class _FailureStreak:
    """Consecutive failed steps: since when, how many, and the last failure's description."""

    since: float
    description: str
    count: int = 1


class Loop:
    """Runs one controller until stopped, waiting `interval` seconds after each step ends.

    The gap is fixed-delay, not fixed-rate: a step that overruns its interval is still
    followed by a full `interval` of rest, so a struggling store is never hammered by
    back-to-back steps. With `retry`, a failed step is followed by `retry` seconds only,
    doubling with each failure in a row up to `interval`, and `retry_now` ends that rest:
    a loop whose store came back finds out within seconds, not an interval later. The loop is unhealthy after `max_silence` seconds without progress
    (by default `unhealthy_after` (3) intervals), and when its steps have kept failing for
    longer than `max_silence`: a failed step is not progress. A failure is logged with its
    traceback when it first occurs or changes; repeats are counted, and the count is logged
    on recovery or change. `clock` drives the heartbeat and failure streaks (tests inject a
    fake one); the sleep itself is real time, and a stop wakes it at once.
    """

    def __init__(
        self,
        controller: Controller,
        *,
        interval: float,
        name: str | None = None,
        unhealthy_after: float | None = None,
        max_silence: float | None = None,
        retry: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        if retry is not None and retry <= 0:
            raise ValueError(f"retry must be positive, got {retry}")
        if unhealthy_after is not None and max_silence is not None:
            raise ValueError(
                "give unhealthy_after (a multiple of interval) or max_silence, not both"
            )
        if max_silence is None:
            max_silence = interval * (3.0 if unhealthy_after is None else unhealthy_after)
        if max_silence <= 0:
            raise ValueError(f"max_silence must be positive, got {max_silence}")
        if isinstance(controller, MonitoredController):
            self.monitored = controller
        else:
            self.monitored = MonitoredController(controller, Heartbeat(clock))
        self.controller = self.monitored.controller
        self.name = name or type(self.controller).__name__
        self.interval = interval
        self.retry = retry
        self.max_silence = max_silence
        self.clock = clock
        self._stop_requested = threading.Event()  # read by the thread runner
        self._wake = asyncio.Event()  # wakes the async runner's sleep
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._done: asyncio.Future[None] | None = None
        self._failure: _FailureStreak | None = None  # the current run of failed steps

    @property
    def heartbeat(self) -> Heartbeat:
        """The controller's heartbeat: beaten on entering each step and by `emit_heartbeat()`."""
        return self.monitored.heartbeat

    @property
    def running(self) -> bool:
        """True while the loop's task or thread is alive."""
        if self._done is None or self._done.done():
            return False
        return self._thread is None or self._thread.is_alive()

    async def start(self) -> None:
        """Start stepping: the first step runs at once."""
        if self.running:
            raise RuntimeError(f"loop {self.name!r} is already running")
        self._stop_requested.clear()
        self._wake = asyncio.Event()
        # Starting is progress: silence is measured from here, not from construction.
        self.heartbeat.beat()
        if self.monitored.is_async:
            self._thread = None
            self._task = asyncio.create_task(self._run_async(), name=f"loop:{self.name}")
            self._done = self._task
        else:
            event_loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = event_loop.create_future()
            self._task, self._done = None, done
            self._thread = threading.Thread(
                target=self._run_thread,
                args=(event_loop, done),
                name=f"loop:{self.name}",
                daemon=True,
            )
            self._thread.start()

    async def stop(self, timeout: float = 5.0) -> bool:
        """Stop in tiers: signal (waking the sleep), wait `timeout` for the step, cancel it, wait.

        Returns True once the loop has ended. A sync step cannot be cancelled: if it is still
        running after the first wait, its daemon thread is abandoned, logged, and False is
        returned. The thread does not hold up process exit.
        """
        if self._done is None or self._done.done():
            return True
        self._stop_requested.set()
        self._wake.set()
        await asyncio.wait({self._done}, timeout=timeout)
        if self._done.done():
            return True
        if self._task is None:
            log.warning(
                "loop %r: sync step still running %ss after stop; abandoning its thread",
                self.name,
                timeout,
            )
            return False
        log.warning("loop %r: step still running %ss after stop; cancelling it", self.name, timeout)
        self._task.cancel()
        await asyncio.wait({self._task}, timeout=timeout)
        if self._task.done():
            return True
        log.error("loop %r: step ignored cancellation for %ss; abandoning it", self.name, timeout)
        return False

    def health(self) -> LoopHealth:
        """Probe liveness: running, not silent nor failing beyond `max_silence`, controller
        healthy. Being stuck is reported before failing (a step that hangs after failures)."""
        if not self.running:
            return LoopHealth(False, "loop is not running")
        silence = self.heartbeat.silence()
        if silence > self.max_silence:
            reason = (
                f"no progress for {_seconds(silence)} (max allowed: {_seconds(self.max_silence)})"
            )
            waiting = self.heartbeat.waiting
            if waiting is not None:
                return LoopHealth(False, f"{reason}: waiting on {waiting}", failing=True)
            return LoopHealth(False, reason)
        if not self.controller.is_healthy:
            return LoopHealth(False, "controller reported itself unhealthy")
        failure = self._failure
        if failure is not None and self.clock() - failure.since > self.max_silence:
            failing = _seconds(self.clock() - failure.since)
            return LoopHealth(
                False,
                f"steps failing for {failing} ({failure.count} in a row): {failure.description}",
                failing=True,
            )
        return LoopHealth(True)

    def retry_now(self) -> None:
        """After a failed step, run the next one now rather than after its rest: what it
        failed on is back (its store). Nothing after a step that succeeded, nor for a loop
        run in a thread."""
        if self._failure is not None and self._task is not None:
            self._wake.set()

    def rest(self) -> float:
        """Seconds to wait before the next step: `interval`, or less after a failure."""
        failure = self._failure
        if failure is None or self.retry is None:
            return self.interval
        return min(self.retry * 2.0 ** min(failure.count - 1, 32), self.interval)

    def _succeeded(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            log.info(
                "loop %r: step succeeded after %d failed in a row (last: %s)",
                self.name,
                failure.count,
                failure.description,
            )

    def _failed(self, exc: BaseException) -> None:
        """Log a failure when it starts or changes; count repeats of the same one."""
        description = f"{type(exc).__name__}: {exc}"
        failure = self._failure
        if failure is not None and failure.description == description:
            failure.count += 1
            return
        if failure is not None:
            log.warning(
                "loop %r: previous failure repeated %d times: %s",
                self.name,
                failure.count,
                failure.description,
            )
        log.error("loop %r: step failed", self.name, exc_info=exc)
        since = self.clock() if failure is None else failure.since
        self._failure = _FailureStreak(
            since, description, 1 if failure is None else failure.count + 1
        )

    async def _run_async(self) -> None:
        task = asyncio.current_task()
        while not self._stop_requested.is_set():
            try:
                result = self.monitored.step()
                if result is not None:
                    await result
                self._succeeded()
            except asyncio.CancelledError as exc:
                if task is not None and task.cancelling():
                    raise
                # Raised by something the step awaited, not by a cancel of this loop.
                self._failed(exc)
            except Exception as exc:
                self._failed(exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.rest())
            self._wake.clear()  # (a stop ends the loop above; `retry_now` wakes it once)

    def _run_thread(
        self, event_loop: asyncio.AbstractEventLoop, done: asyncio.Future[None]
    ) -> None:
        try:
            while not self._stop_requested.is_set():
                try:
                    result = self.monitored.step()
                    if inspect.isawaitable(result):
                        if inspect.iscoroutine(result):
                            result.close()
                        raise TypeError("step() returned an awaitable; declare it `async def`")
                    self._succeeded()
                except Exception as exc:
                    self._failed(exc)
                self._stop_requested.wait(self.rest())
        finally:
            # A closed event loop raises RuntimeError: then nobody is waiting.
            with contextlib.suppress(RuntimeError):
                event_loop.call_soon_threadsafe(_resolve, done)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _seconds(value: float) -> str:
    """47.0 -> '47s', 15.14 -> '15.1s', 0.1534 -> '0.153s': enough digits to compare."""
    return f"{round(value, 1 if value >= 1 else 3):g}s"
