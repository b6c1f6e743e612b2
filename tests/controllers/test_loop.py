from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time

import pytest

from shoal.controllers import Controller, HeartbeatMixin, Loop, LoopHealth
from shoal.controllers.loop import _FailureStreak
from tests.controllers.support import FakeClock
from tests.helpers import wait_for


class Batch(HeartbeatMixin, Controller):
    """One long step over many items (400 at 125 ms each); later steps have nothing to do."""

    def __init__(self, clock: FakeClock, *, report_progress: bool) -> None:
        self.clock = clock
        self.report_progress = report_progress
        self.loop: Loop | None = None
        self.healths: list[LoopHealth] = []
        self.done = False

    def step(self) -> None:
        if self.done:
            return
        assert self.loop is not None
        for _ in range(400):
            self.clock.advance(0.125)
            if self.report_progress:
                self.emit_heartbeat()
            self.healths.append(self.loop.health())
        self.done = True


class Counter(Controller):
    """Counts steps; the first `failures` steps raise."""

    def __init__(self, failures: int = 0) -> None:
        self.steps = 0
        self.failures = failures
        self.threads: set[str] = set()

    def step(self) -> None:
        self.steps += 1
        self.threads.add(threading.current_thread().name)
        if self.steps <= self.failures:
            raise RuntimeError(f"step {self.steps} failed")


class AsyncCounter(Counter):
    async def step(self) -> None:  # type: ignore[override]
        super().step()


class SyncStuck(HeartbeatMixin, Controller):
    """Beats, then blocks on one call until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def step(self) -> None:
        self.emit_heartbeat()
        self.entered.set()
        self.release.wait()


class AsyncStuck(HeartbeatMixin, Controller):
    """Beats, then awaits one call until released or cancelled."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = asyncio.Event()
        self.cancelled = False

    async def step(self) -> None:
        self.emit_heartbeat()
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class Flagged(Controller):
    def __init__(self) -> None:
        self.healthy = True

    async def step(self) -> None:
        pass

    @property
    def is_healthy(self) -> bool:
        return self.healthy


async def test_long_step_reporting_progress_stays_healthy_past_deadline() -> None:
    clock = FakeClock()
    controller = Batch(clock, report_progress=True)
    loop = controller.loop = Loop(controller, interval=5.0, clock=clock)
    began = clock.now
    await loop.start()
    try:
        await wait_for(lambda: controller.done, message="the long step to finish")
    finally:
        await loop.stop()
    assert clock.now - began == 50.0  # far past the 15 s deadline
    assert all(health.healthy for health in controller.healths)


async def test_long_step_reporting_nothing_goes_unhealthy_after_deadline_with_reason() -> None:
    clock = FakeClock()
    controller = Batch(clock, report_progress=False)
    loop = controller.loop = Loop(controller, interval=5.0, clock=clock)
    await loop.start()
    try:
        await wait_for(lambda: controller.done, message="the long step to finish")
    finally:
        await loop.stop()
    # Healthy for the first 15 s of silence (120 items), unhealthy from then on.
    assert all(health.healthy for health in controller.healths[:120])
    assert controller.healths[120] == LoopHealth(False, "no progress for 15.1s (max allowed: 15s)")
    assert not any(health.healthy for health in controller.healths[120:])


async def test_controller_reporting_nothing_is_judged_by_step_entry_beats() -> None:
    """Each step overruns its interval by 40%; steps entering keep a silent controller alive."""

    class Quiet(Controller):
        def __init__(self) -> None:
            self.healths: list[LoopHealth] = []

        def step(self) -> None:
            if len(self.healths) < 10:
                clock.advance(0.014)
                self.healths.append(loop.health())

    clock = FakeClock()
    controller = Quiet()
    loop = Loop(controller, interval=0.01, clock=clock)
    await loop.start()
    try:
        await wait_for(lambda: len(controller.healths) == 10, message="ten steps")
    finally:
        await loop.stop()
    assert all(health.healthy for health in controller.healths)


async def test_unhealthy_reason_names_the_silence_and_the_allowed_maximum() -> None:
    clock = FakeClock()
    controller = AsyncStuck()
    loop = Loop(controller, interval=5.0, clock=clock)
    await loop.start()
    try:
        await wait_for(controller.entered.is_set, message="the step to start")
        clock.advance(47.0)
        assert loop.health() == LoopHealth(False, "no progress for 47s (max allowed: 15s)")
    finally:
        controller.release.set()
        await loop.stop()


@pytest.mark.parametrize("stuck", [SyncStuck, AsyncStuck])
async def test_step_blocked_forever_is_caught_even_after_beating(
    stuck: type[SyncStuck | AsyncStuck],
) -> None:
    controller = stuck()
    loop = Loop(controller, interval=0.02, max_silence=0.1)
    await loop.start()
    try:
        await wait_for(controller.entered.is_set, message="the step to start")
        await wait_for(
            lambda: not loop.health().healthy, message="the blocked loop to turn unhealthy"
        )
        reason = loop.health().reason
        assert reason is not None and reason.startswith("no progress for ")
        assert reason.endswith("(max allowed: 0.1s)")
    finally:
        controller.release.set()
        await loop.stop()


@pytest.mark.parametrize("counter", [Counter, AsyncCounter])
async def test_exception_in_step_is_logged_and_the_next_step_runs(
    counter: type[Counter], caplog: pytest.LogCaptureFixture
) -> None:
    controller = counter(failures=1)
    loop = Loop(controller, name="flaky", interval=0.01)
    await loop.start()
    try:
        await wait_for(lambda: controller.steps >= 3, message="steps after the failing one")
    finally:
        await loop.stop()
    [failure] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "flaky" in failure.getMessage()
    assert failure.exc_info is not None
    assert str(failure.exc_info[1]) == "step 1 failed"


async def test_sync_step_runs_in_the_loops_own_thread() -> None:
    controller = Counter()
    loop = Loop(controller, name="blocking", interval=0.01)
    await loop.start()
    try:
        await wait_for(lambda: controller.steps >= 2, message="two steps")
    finally:
        await loop.stop()
    assert controller.threads == {"loop:blocking"}


@pytest.mark.parametrize("counter", [Counter, AsyncCounter])
async def test_stop_interrupts_the_sleep_promptly(counter: type[Counter]) -> None:
    controller = counter()
    loop = Loop(controller, interval=60.0)
    await loop.start()
    await wait_for(lambda: controller.steps == 1, message="the first step")
    started = time.monotonic()
    assert await loop.stop(timeout=5.0)
    assert time.monotonic() - started < 1.0
    assert not loop.running


async def test_tiered_shutdown_cancels_a_stuck_async_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    controller = AsyncStuck()
    loop = Loop(controller, name="stuck", interval=0.01)
    await loop.start()
    await wait_for(controller.entered.is_set, message="the step to start")
    assert await loop.stop(timeout=0.05)
    assert controller.cancelled
    assert not loop.running
    assert any("cancelling" in r.getMessage() for r in caplog.records)


async def test_tiered_shutdown_abandons_a_stuck_sync_step_and_reports_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    controller = SyncStuck()
    loop = Loop(controller, name="stuck", interval=0.01)
    await loop.start()
    try:
        await wait_for(controller.entered.is_set, message="the step to start")
        assert not await loop.stop(timeout=0.05)
        assert loop.running  # a thread cannot be cancelled
        [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert "'stuck'" in warning.getMessage() and "abandoning" in warning.getMessage()
    finally:
        controller.release.set()
    await wait_for(lambda: not loop.running, message="the released thread to end")


async def test_loop_that_is_not_running_is_unhealthy() -> None:
    loop = Loop(Counter(), interval=60.0)
    assert loop.health() == LoopHealth(False, "loop is not running")
    await loop.start()
    assert loop.health() == LoopHealth(True)
    await loop.stop()
    assert loop.health() == LoopHealth(False, "loop is not running")


async def test_controller_reporting_itself_unhealthy_makes_the_loop_unhealthy() -> None:
    controller = Flagged()
    loop = Loop(controller, interval=60.0)
    await loop.start()
    try:
        controller.healthy = False
        assert loop.health() == LoopHealth(False, "controller reported itself unhealthy")
        controller.healthy = True
        assert loop.health() == LoopHealth(True)
    finally:
        await loop.stop()


def test_max_silence_is_three_intervals_unless_configured() -> None:
    assert Loop(Counter(), interval=5.0).max_silence == 15.0
    assert Loop(Counter(), interval=5.0, unhealthy_after=2).max_silence == 10.0
    assert Loop(Counter(), interval=5.0, max_silence=60.0).max_silence == 60.0
    with pytest.raises(ValueError):
        Loop(Counter(), interval=5.0, unhealthy_after=2, max_silence=60.0)


async def test_loop_cannot_be_started_twice_while_running() -> None:
    loop = Loop(Counter(), interval=60.0)
    await loop.start()
    try:
        with pytest.raises(RuntimeError):
            await loop.start()
    finally:
        await loop.stop()


class Timed(Controller):
    """Each step takes `duration` real seconds; records when each step started and ended."""

    def __init__(self, duration: float) -> None:
        self.duration = duration
        self.spans: list[tuple[float, float]] = []

    async def step(self) -> None:
        start = time.monotonic()
        await asyncio.sleep(self.duration)  # the step's length, under test
        self.spans.append((start, time.monotonic()))


async def test_loop_rests_a_full_interval_after_a_step_that_overran() -> None:
    controller = Timed(duration=0.15)
    loop = Loop(controller, interval=0.1)
    await loop.start()
    try:
        await wait_for(lambda: len(controller.spans) >= 3, message="three steps", timeout=5.0)
    finally:
        await loop.stop()
    gaps = [nxt[0] - prev[1] for prev, nxt in itertools.pairwise(controller.spans)]
    assert all(gap >= 0.1 * 0.95 for gap in gaps), gaps


class Failing(Controller):
    """Fails with the same error while `failing`, then succeeds; counts steps."""

    def __init__(self, message: str = "store unreachable") -> None:
        self.failing = True
        self.message = message
        self.steps = 0

    async def step(self) -> None:
        self.steps += 1
        if self.failing:
            raise ConnectionError(self.message)


async def test_steps_failing_past_the_deadline_make_the_loop_unhealthy_with_the_failure() -> None:
    clock = FakeClock()
    controller = Failing()
    loop = Loop(controller, interval=0.01, max_silence=15.0, clock=clock)
    await loop.start()
    try:
        await wait_for(lambda: controller.steps >= 2, message="two failed steps")
        assert loop.health().healthy  # failing, but not for longer than the deadline yet
        clock.advance(16.0)
        steps = controller.steps
        await wait_for(lambda: controller.steps > steps, message="a step after the deadline")
        health = loop.health()
        assert not health.healthy
        assert health.failing  # the loop runs: its steps fail, it is not stuck
        assert health.reason is not None
        assert health.reason.startswith("steps failing for 16s")
        assert health.reason.endswith("ConnectionError: store unreachable")
        controller.failing = False
        await wait_for(lambda: loop.health().healthy, message="recovery after a successful step")
    finally:
        await loop.stop()


async def test_a_failed_step_is_tried_again_after_a_short_rest_doubling_to_the_interval() -> None:
    """A failed step waited a whole interval for the next: a frontend's reconciler (30 s)
    whose store came back went on reporting it failing for up to 30 s. With `retry` the
    rest after a failure starts short and doubles with each failure in a row, up to the
    interval; after a success it is the interval again."""
    controller = Failing()
    loop = Loop(controller, interval=3600.0, retry=0.01)
    await loop.start()
    try:
        await wait_for(lambda: controller.steps >= 4, message="steps retried, not an hour apart")
        assert loop.rest() == min(0.01 * 2 ** (controller.steps - 1), 3600.0)
        controller.failing = False
        await wait_for(lambda: loop.health().healthy and loop.rest() == 3600.0)
    finally:
        await loop.stop()
    for failures, rest in [(1, 0.01), (2, 0.02), (3, 0.04), (20, 3600.0), (10**6, 3600.0)]:
        loop._failure = _FailureStreak(0.0, "x", failures)
        assert loop.rest() == pytest.approx(rest)


async def test_retry_now_ends_the_rest_after_a_failed_step() -> None:
    """What a step failed on is back (a store watch saw it): the next step runs now."""
    controller = Failing()
    loop = Loop(controller, interval=3600.0, retry=3600.0)
    await loop.start()
    try:
        await wait_for(lambda: controller.steps == 1, message="the first step, failed")
        controller.failing = False
        loop.retry_now()
        await wait_for(lambda: controller.steps == 2, message="the next step at once")
        await wait_for(lambda: loop.health().healthy, message="recovered")
    finally:
        await loop.stop()


async def test_a_step_failing_the_same_way_logs_once_then_a_count_on_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="shoal.controllers.loop")
    controller = Failing()
    loop = Loop(controller, name="lister", interval=0.005)
    await loop.start()
    try:
        await wait_for(lambda: controller.steps >= 6, message="six failed steps")
        controller.failing = False
        failed = controller.steps
        await wait_for(lambda: controller.steps > failed + 1, message="steps after recovery")
    finally:
        await loop.stop()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    [recovered] = [r for r in caplog.records if "succeeded after" in r.getMessage()]
    assert f"{failed} failed in a row" in recovered.getMessage()
    assert "store unreachable" in recovered.getMessage()


async def test_a_changed_failure_is_logged_with_the_count_of_the_previous_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    controller = Failing("first")
    loop = Loop(controller, name="lister", interval=0.005)
    await loop.start()
    try:
        await wait_for(lambda: controller.steps >= 3, message="three failed steps")
        controller.message = "second"
        await wait_for(
            lambda: sum(r.levelno >= logging.ERROR for r in caplog.records) == 2,
            message="the changed failure logged",
        )
    finally:
        await loop.stop()
    [repeated] = [r for r in caplog.records if "repeated" in r.getMessage()]
    assert "ConnectionError: first" in repeated.getMessage()


class WaitsOnTheStore(HeartbeatMixin, Controller):
    """Each step waits on the store (a shared dependency) until released."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def step(self) -> None:
        with self.waiting_on("the store"):
            self.entered.set()
            await self.release.wait()


async def test_a_loop_silent_while_waiting_on_a_shared_dependency_is_failing_not_stuck() -> None:
    clock = FakeClock()
    controller = WaitsOnTheStore()
    loop = Loop(controller, interval=5.0, clock=clock)
    await loop.start()
    try:
        await wait_for(controller.entered.is_set, message="the step to wait on the store")
        clock.advance(47.0)
        assert loop.health() == LoopHealth(
            False, "no progress for 47s (max allowed: 15s): waiting on the store", failing=True
        )
        controller.entered.clear()
        controller.release.set()  # the store answers: the wait was not the loop's silence
        await wait_for(lambda: loop.heartbeat.waiting is None)
        assert loop.health() == LoopHealth(True)
    finally:
        controller.release.set()
        await loop.stop()
