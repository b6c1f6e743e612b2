"""Layer 4: control loops whose liveness follows progress, and readiness with reasons.

A `Controller` does one `step()`; a `Loop` runs it with a rest of one interval after each
step and judges it alive while its `Heartbeat` keeps beating and its steps do not keep
failing; a `ControllerManager` holds a process's loops
and answers readiness with the reason each unhealthy loop is unhealthy.
"""

from __future__ import annotations

from shoal.controllers.heartbeat import Controller, Heartbeat, HeartbeatMixin
from shoal.controllers.http import readiness
from shoal.controllers.loop import Loop, LoopHealth, MonitoredController
from shoal.controllers.manager import ControllerManager
from shoal.controllers.metrics import LoopCollector

__all__ = [
    "Controller",
    "ControllerManager",
    "Heartbeat",
    "HeartbeatMixin",
    "Loop",
    "LoopCollector",
    "LoopHealth",
    "MonitoredController",
    "readiness",
]
