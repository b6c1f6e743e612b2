"""`Health`: what a worker's `/live` and `/health` answer, with the reasons it is unhealthy."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from typing import Any

from shoal.controllers import ControllerManager
from shoal.discovery import EndpointId
from shoal.discovery.keys import quoted
from shoal.worker.endpoint import Endpoint
from shoal.worker.registrations import Registrations

ENGINE_CHECK_TIMEOUT = 5.0
"""Seconds an engine's `check_health()` gets before the endpoint counts as unhealthy."""
REFUSED_SHOWN = 5
"""Models an endpoint refused that `/health` names (with why); the rest are counted."""


class Health:
    """A worker process's health: live until its drain begins; healthy when every endpoint
    serves, its engine answers and the lease is held with everything registered under it."""

    def __init__(
        self,
        endpoints: Mapping[EndpointId, Endpoint],
        loops: ControllerManager,
        registrations: Registrations,
        draining: asyncio.Event,
    ) -> None:
        self.endpoints = endpoints
        self.loops = loops
        self.registrations = registrations
        self.draining = draining

    @property
    def live(self) -> bool:
        """True while running and not shutting down."""
        return not self.draining.is_set()

    async def check(self) -> tuple[bool, dict[str, Any]]:
        """Whether the process is healthy, and the `/health` body: reasons, instance, endpoints."""
        reasons: list[str] = []
        if self.draining.is_set():
            reasons.append("draining")
        reasons.extend(f"loop {name}: {why}" for name, why in self.loops.unhealthy().items())
        lease_reason = self.registrations.lease_problem()
        if lease_reason:
            reasons.append(lease_reason)
        endpoints = []
        for ep in self.endpoints.values():
            if not ep.serving or ep.engine is None:
                reasons.append(f"endpoint {ep.id} is not serving")
                continue
            try:
                await asyncio.wait_for(ep.engine.check_health(), ENGINE_CHECK_TIMEOUT)
            except Exception as exc:
                reasons.append(f"endpoint {ep.id}: engine {ep.engine.name} unhealthy: {exc}")
            endpoints.append(_endpoint_body(ep))
        lease = self.registrations.lease
        body = {
            "status": "unavailable" if reasons else "ok",
            "reasons": reasons,
            "instance_id": None if lease is None else f"{lease.id:x}",
            "endpoints": endpoints,
        }
        return not reasons, body


def _endpoint_body(ep: Endpoint) -> dict[str, Any]:
    """What `/health` says of a serving endpoint: its URL, requests in flight, its models,
    and the models its engine lists that could not be announced (not a reason to be
    unhealthy: the others are announced)."""
    refused = itertools.islice(ep.refused.items(), REFUSED_SHOWN)
    return {
        "endpoint": str(ep.id),
        "url": ep.url,
        "in_flight": ep.in_flight,
        "models_refused": len(ep.refused),
        "refused": [{"name": quoted(name), "reason": why} for name, (_, why) in refused],
        "models": [
            {
                "name": att.card.display_name,
                "suffix": suffix,
                "mdcsum": att.card.mdcsum,
                "taints": list(att.card.taints),
            }
            for suffix, att in ep.models.items()
        ],
    }
