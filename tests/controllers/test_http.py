from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from shoal.controllers import (
    Controller,
    ControllerManager,
    Loop,
    add_health_routes,
    liveness,
    readiness,
)
from tests.controllers.support import wait_for


class Gated(Controller):
    """Each step waits for the gate: closed, the loop makes no progress."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def step(self) -> None:
        await self.gate.wait()


async def test_ready_answers_503_with_reasons_then_200_after_recovery() -> None:
    controller = Gated()
    manager = ControllerManager([Loop(controller, name="models", interval=0.02, max_silence=0.1)])
    app = web.Application()
    add_health_routes(app, manager)
    await manager.start_all()
    try:
        async with TestClient(TestServer(app)) as client:
            await wait_for(lambda: manager.unhealthy(), "the gated loop to turn unhealthy")
            response = await client.get("/health/ready")
            assert response.status == 503
            body = await response.json()
            assert body["status"] == "unavailable"
            assert list(body["unhealthy"]) == ["models"]
            assert body["unhealthy"]["models"].startswith("no progress for ")

            controller.gate.set()
            await wait_for(lambda: not manager.unhealthy(), "the loop to recover")
            response = await client.get("/health/ready")
            assert response.status == 200
            assert await response.json() == {"status": "ok", "unhealthy": {}}
    finally:
        await manager.stop_all()


async def test_live_answers_200_while_the_process_runs() -> None:
    manager = ControllerManager([Loop(Gated(), name="stopped", interval=1.0)])
    app = web.Application()
    add_health_routes(app, manager, prefix="/status/health/")
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/status/health/live")
        assert response.status == 200
        # Readiness fails (the loop never started), liveness does not care.
        assert (await client.get("/status/health/ready")).status == 503


def test_neutral_functions_answer_without_a_web_framework() -> None:
    manager = ControllerManager([Loop(Gated(), name="stopped", interval=1.0)])
    assert readiness(manager) == (
        503,
        {"status": "unavailable", "unhealthy": {"stopped": "loop is not running"}},
    )
    manager.unregister("stopped")
    assert readiness(manager) == (200, {"status": "ok", "unhealthy": {}})
    assert liveness() == (200, {"status": "ok"})
