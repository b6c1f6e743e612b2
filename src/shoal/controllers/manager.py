"""`ControllerManager`: the loops of one process, by name, and their health with reasons.

Health is logged on edges only: a WARNING naming the loop and the reason when it turns
unhealthy, an INFO when it recovers, nothing on the probes in between, so a readiness
probe every second does not flood the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from shoal.controllers.loop import Loop, LoopHealth

log = logging.getLogger(__name__)


class ControllerManager:
    """Registers loops by name, starts and stops them together, and reports their health."""

    def __init__(self, loops: Iterable[Loop] = ()) -> None:
        self._loops: dict[str, Loop] = {}
        self._healthy: dict[str, bool] = {}  # last reported state, for edge-only logging
        for loop in loops:
            self.register(loop)

    @property
    def loops(self) -> Mapping[str, Loop]:
        """The registered loops by name (read-only)."""
        return MappingProxyType(self._loops)

    def register(self, loop: Loop) -> Loop:
        """Add `loop` under `loop.name`; a name already registered is a `ValueError`."""
        if loop.name in self._loops:
            raise ValueError(f"a loop named {loop.name!r} is already registered")
        self._loops[loop.name] = loop
        return loop

    def unregister(self, name: str) -> Loop:
        """Remove the loop called `name` and return it; stopping it is up to the caller."""
        loop = self._loops.pop(name)
        self._healthy.pop(name, None)
        return loop

    async def start_all(self) -> None:
        """Start every registered loop that is not running."""
        for loop in self._loops.values():
            if not loop.running:
                await loop.start()

    async def stop_all(self, timeout: float = 5.0) -> bool:
        """Stop every loop at once (see `Loop.stop`); True if all of them ended."""
        results = await asyncio.gather(*(loop.stop(timeout) for loop in self._loops.values()))
        return all(results)

    def health(self) -> dict[str, LoopHealth]:
        """Probe every loop. A probe that raises counts as unhealthy; changes are logged once."""
        report: dict[str, LoopHealth] = {}
        for name, loop in list(self._loops.items()):
            error: Exception | None = None
            try:
                health = loop.health()
            except Exception as exc:
                error = exc
                health = LoopHealth(False, f"health check raised {type(exc).__name__}: {exc}")
            self._record(name, health, error)
            report[name] = health
        return report

    def unhealthy(self) -> dict[str, str]:
        """Every unhealthy loop and its reason; empty when all are healthy."""
        return {
            name: health.reason or "unhealthy"
            for name, health in self.health().items()
            if not health.healthy
        }

    def stuck(self) -> dict[str, str]:
        """The loops stuck on their own work, and why: unhealthy, and not merely because
        their steps keep failing on something outside the process (`LoopHealth.failing`).
        What a readiness probe fails for."""
        return {
            name: health.reason or "unhealthy"
            for name, health in self.health().items()
            if not health.healthy and not health.failing
        }

    def _record(self, name: str, health: LoopHealth, error: Exception | None) -> None:
        was_healthy = self._healthy.get(name, True)
        self._healthy[name] = health.healthy
        if was_healthy and not health.healthy:
            log.warning("loop %r is unhealthy: %s", name, health.reason, exc_info=error)
        elif health.healthy and not was_healthy:
            log.info("loop %r recovered", name)
