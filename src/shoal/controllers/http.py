"""Health endpoints: `GET /health/ready` (503 with reasons while a loop is unhealthy) and `/health/live`.

`readiness()` and `liveness()` are framework-neutral, returning `(status, body)` for any
server to serialize as JSON; `add_health_routes()` mounts them on an aiohttp application.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

    from shoal.controllers.manager import ControllerManager


def readiness(manager: ControllerManager) -> tuple[int, dict[str, Any]]:
    """200 when every loop is healthy, else 503 with every unhealthy loop and its reason."""
    unhealthy = manager.unhealthy()
    if unhealthy:
        return 503, {"status": "unavailable", "unhealthy": unhealthy}
    return 200, {"status": "ok", "unhealthy": {}}


def liveness() -> tuple[int, dict[str, Any]]:
    """200 while the process runs: answering at all is the proof."""
    return 200, {"status": "ok"}


def add_health_routes(
    app: web.Application, manager: ControllerManager, prefix: str = "/health"
) -> None:
    """Mount `GET {prefix}/ready` and `GET {prefix}/live` on an aiohttp application."""
    from aiohttp import web

    async def ready(request: web.Request) -> web.Response:
        status, body = readiness(manager)
        return web.json_response(body, status=status)

    async def live(request: web.Request) -> web.Response:
        status, body = liveness()
        return web.json_response(body, status=status)

    prefix = prefix.rstrip("/")
    app.router.add_get(f"{prefix}/ready", ready)
    app.router.add_get(f"{prefix}/live", live)
