from __future__ import annotations

from collections.abc import Callable

from shoal.controllers import Controller, Heartbeat, HeartbeatMixin, MonitoredController
from tests.controllers.support import FakeClock


class Items(HeartbeatMixin, Controller):
    """Processes its items through a helper that only sees `emit_heartbeat`."""

    def __init__(self, clock: FakeClock, items: int) -> None:
        self.clock = clock
        self.items = items

    def step(self) -> None:
        process(self.items, self.clock, self.emit_heartbeat)


def process(items: int, clock: FakeClock, emit_heartbeat: Callable[[], None]) -> None:
    for _ in range(items):
        clock.advance(1.0)
        emit_heartbeat()


class Quiet(Controller):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def step(self) -> None:
        self.clock.advance(7.0)


def test_emit_heartbeat_is_a_no_op_until_a_heartbeat_is_attached() -> None:
    controller = Items(FakeClock(), items=3)
    controller.step()  # nothing attached: nothing to beat, nothing raised


def test_controller_is_healthy_by_default() -> None:
    assert Quiet(FakeClock()).is_healthy


def test_heartbeat_measures_silence_since_the_last_beat() -> None:
    clock = FakeClock()
    heartbeat = Heartbeat(clock)
    clock.advance(4.0)
    assert heartbeat.silence() == 4.0
    heartbeat.beat()
    assert heartbeat.silence() == 0.0


def test_helpers_report_progress_through_the_bound_emit_heartbeat() -> None:
    clock = FakeClock()
    monitored = MonitoredController(Items(clock, items=5), Heartbeat(clock))
    monitored.step()
    # Five items of one second each, the last one beat just now.
    assert monitored.heartbeat.silence() == 0.0


def test_monitored_controller_beats_on_entering_each_step() -> None:
    clock = FakeClock()
    monitored = MonitoredController(Quiet(clock), Heartbeat(clock))
    clock.advance(100.0)
    monitored.step()
    # The beat came on entry; the step's own 7 s of work reported nothing.
    assert monitored.heartbeat.silence() == 7.0
