from __future__ import annotations

import asyncio

from shoal.controllers import Controller, ControllerManager, Loop, readiness
from tests.helpers import wait_for


class Gated(Controller):
    """Each step waits for the gate: closed, the loop makes no progress."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def step(self) -> None:
        await self.gate.wait()


async def test_readiness_is_503_with_reasons_then_200_after_recovery() -> None:
    controller = Gated()
    manager = ControllerManager([Loop(controller, name="models", interval=0.02, max_silence=0.1)])
    await manager.start_all()
    try:
        await wait_for(lambda: manager.unhealthy(), message="the gated loop to turn unhealthy")
        status, body = readiness(manager)
        assert status == 503
        assert body["status"] == "unavailable"
        assert list(body["unhealthy"]) == ["models"]
        assert body["unhealthy"]["models"].startswith("no progress for ")

        controller.gate.set()
        await wait_for(lambda: not manager.unhealthy(), message="the loop to recover")
        assert readiness(manager) == (200, {"status": "ok", "unhealthy": {}})
    finally:
        await manager.stop_all()


def test_readiness_names_a_loop_that_is_not_running() -> None:
    manager = ControllerManager([Loop(Gated(), name="stopped", interval=1.0)])
    assert readiness(manager) == (
        503,
        {"status": "unavailable", "unhealthy": {"stopped": "loop is not running"}},
    )
    manager.unregister("stopped")
    assert readiness(manager) == (200, {"status": "ok", "unhealthy": {}})
