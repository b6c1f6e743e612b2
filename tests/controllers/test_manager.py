from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from shoal.controllers import Controller, ControllerManager, Loop, LoopHealth
from tests.helpers import wait_for


class Flagged(Controller):
    """Healthy while `healthy` is true; its health check raises while `broken` is true."""

    def __init__(self) -> None:
        self.healthy = True
        self.broken = False

    async def step(self) -> None:
        pass

    @property
    def is_healthy(self) -> bool:
        if self.broken:
            raise RuntimeError("boom")
        return self.healthy


def manager_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "shoal.controllers.manager"]


@pytest.fixture
async def models(
    caplog: pytest.LogCaptureFixture,
) -> AsyncIterator[tuple[Flagged, ControllerManager]]:
    """A started manager of one loop, `models`, with its controller; its logs are captured."""
    caplog.set_level(logging.INFO, logger="shoal.controllers")
    controller = Flagged()
    manager = ControllerManager([Loop(controller, name="models", interval=60.0)])
    await manager.start_all()
    yield controller, manager
    await manager.stop_all()


def test_duplicate_loop_name_is_rejected() -> None:
    manager = ControllerManager([Loop(Flagged(), name="models", interval=1.0)])
    with pytest.raises(ValueError, match="models"):
        manager.register(Loop(Flagged(), name="models", interval=1.0))


def test_unregistered_loop_is_no_longer_reported() -> None:
    loop = Loop(Flagged(), name="models", interval=1.0)
    manager = ControllerManager([loop])
    assert manager.unhealthy() == {"models": "loop is not running"}
    assert manager.unregister("models") is loop
    assert manager.unhealthy() == {}
    assert "models" not in manager.loops
    with pytest.raises(KeyError):
        manager.unregister("models")


async def test_start_all_and_stop_all_run_every_loop() -> None:
    manager = ControllerManager(
        [Loop(Flagged(), name="a", interval=60.0), Loop(Flagged(), name="b", interval=60.0)]
    )
    await manager.start_all()
    assert all(loop.running for loop in manager.loops.values())
    assert manager.health() == {"a": LoopHealth(True), "b": LoopHealth(True)}
    assert await manager.stop_all(timeout=1.0)
    assert not any(loop.running for loop in manager.loops.values())


async def test_health_changes_are_logged_once_per_edge_not_per_probe(
    models: tuple[Flagged, ControllerManager], caplog: pytest.LogCaptureFixture
) -> None:
    controller, manager = models
    for _ in range(3):
        assert manager.unhealthy() == {}
    assert manager_records(caplog) == []

    controller.healthy = False
    for _ in range(3):
        assert manager.unhealthy() == {"models": "controller reported itself unhealthy"}
    [warning] = manager_records(caplog)
    assert warning.levelno == logging.WARNING
    assert "'models'" in warning.getMessage()
    assert "controller reported itself unhealthy" in warning.getMessage()

    controller.healthy = True
    for _ in range(3):
        assert manager.unhealthy() == {}
    [_, recovery] = manager_records(caplog)
    assert recovery.levelno == logging.INFO
    assert "'models'" in recovery.getMessage()


async def test_health_check_that_raises_counts_as_unhealthy_and_is_logged_once(
    models: tuple[Flagged, ControllerManager], caplog: pytest.LogCaptureFixture
) -> None:
    controller, manager = models
    controller.broken = True
    for _ in range(3):
        assert manager.unhealthy() == {"models": "health check raised RuntimeError: boom"}
    [warning] = manager_records(caplog)
    assert warning.levelno == logging.WARNING
    assert warning.exc_info is not None

    controller.broken = False
    assert manager.unhealthy() == {}
    assert [r.levelno for r in manager_records(caplog)] == [logging.WARNING, logging.INFO]


class Failing(Controller):
    """Every step fails, as a step against a store that is down does."""

    def __init__(self) -> None:
        self.steps = 0

    async def step(self) -> None:
        self.steps += 1
        raise ConnectionError("store unreachable")


async def test_a_loop_whose_steps_keep_failing_is_unhealthy_but_not_stuck(
    models: tuple[Flagged, ControllerManager],
) -> None:
    controller, manager = models
    failing = Failing()
    manager.register(Loop(failing, name="failing", interval=0.02, max_silence=0.5))
    await manager.start_all()
    await wait_for(lambda: "failing" in manager.unhealthy(), message="failing past the deadline")
    assert manager.unhealthy()["failing"].startswith("steps failing for")
    assert manager.stuck() == {}  # a shared dependency down: no readiness probe fails for it
    controller.healthy = False  # a loop stuck on its own work is what readiness fails for
    assert manager.stuck() == {"models": "controller reported itself unhealthy"}
