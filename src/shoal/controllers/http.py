"""Readiness of a process's control loops, framework-neutral: `readiness()` returns
`(status, body)` for any server to serialize as JSON (the frontend serves it at
`/health/controllers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.controllers.manager import ControllerManager


def readiness(manager: ControllerManager) -> tuple[int, dict[str, Any]]:
    """200 when every loop is healthy, else 503 with every unhealthy loop and its reason."""
    unhealthy = manager.unhealthy()
    if unhealthy:
        return 503, {"status": "unavailable", "unhealthy": unhealthy}
    return 200, {"status": "ok", "unhealthy": {}}
