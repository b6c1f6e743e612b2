"""`LoopCollector`: the health of a process's control loops as Prometheus gauges.

Read at scrape time from the `ControllerManager`, so a loop that hangs is visible on
`/metrics` (and alertable) without anyone calling the health endpoint.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shoal.controllers.manager import ControllerManager


class LoopCollector(Collector):
    """`shoal_loop_healthy{loop}` (1 or 0) and `shoal_loop_heartbeat_age_seconds{loop}`."""

    def __init__(self, manager: ControllerManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "shoal_loop_healthy",
            "1 while a control loop runs, makes progress and its controller is healthy.",
            labels=["loop"],
        )
        age = GaugeMetricFamily(
            "shoal_loop_heartbeat_age_seconds",
            "Seconds since a control loop last reported progress.",
            labels=["loop"],
        )
        health = self.manager.health()
        for name, loop in sorted(self.manager.loops.items()):
            probe = health.get(name)
            healthy.add_metric([name], 1.0 if probe is not None and probe.healthy else 0.0)
            age.add_metric([name], loop.heartbeat.silence())
        yield healthy
        yield age
