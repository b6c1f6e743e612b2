"""`Health`: what a worker's `/live` and `/health` answer, with the reasons it is unhealthy."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Mapping
from typing import Any, Protocol

from shoal.controllers import ControllerManager
from shoal.discovery import EndpointId
from shoal.discovery.keys import quoted
from shoal.worker.endpoint import Endpoint
from shoal.worker.registrations import Registrations

ENGINE_CHECK_TIMEOUT = 5.0
"""Seconds an engine's `check_health()` gets before the endpoint counts as unhealthy."""
REFUSED_SHOWN = 5
"""Models an endpoint refused that `/health` names (with why); the rest are counted."""
MODELS_SHOWN = 10
"""Models of an endpoint that `/health` and the ready line name (its base model, then its
adapters by name); the rest are counted. A sidecar may announce 65,536."""
NAMES_PER_TURN = 4096
"""Models the choice of those shown looks at in one turn of the event loop."""


class _Named(Protocol):
    @property
    def display_name(self) -> str: ...


class _HasCard(Protocol):
    @property
    def card(self) -> _Named: ...


async def first_by_name(models: Mapping[str | None, _HasCard], n: int) -> list[str | None]:
    """The suffixes of `models`' first `n`: the base model's (None), then its adapters' by
    name. A snapshot is looked at `NAMES_PER_TURN` models per turn of the event loop, so a
    suffix may be gone when the answer comes."""
    items = list(models.items())  # (the models may change while this yields)
    base: list[str | None] = [None] if None in models else []
    smallest: list[tuple[str, str]] = []  # (name, suffix) of the adapters' first, so far
    for start in range(0, len(items), NAMES_PER_TURN):
        if start:
            await asyncio.sleep(0)
        names = (
            (att.card.display_name, suffix)
            for suffix, att in items[start : start + NAMES_PER_TURN]
            if suffix is not None
        )
        smallest = heapq.nsmallest(n - len(base), itertools.chain(smallest, names))
    return [*base, *(suffix for _, suffix in smallest)][:n]


class Health:
    """A worker process's health: live until its drain begins; healthy when it serves an
    endpoint, every endpoint serves with its models announced (one at least, for one that
    follows its engine: none is nothing to route to), its engine answers and the lease is
    held with everything registered under it."""

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
        # The suffixes `/health` shows of each endpoint's models, with the count of changes
        # to the attached models they were chosen at (chosen again once that moves on).
        self._shown: dict[EndpointId, tuple[int, list[str | None]]] = {}

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
        if not self.endpoints:
            reasons.append("no endpoint is served yet")
        for ep in self.endpoints.values():
            if not ep.serving or ep.engine is None:
                reasons.append(f"endpoint {ep.id} is not serving")
                continue
            if not ep.announced:  # (its port is open; its instance or models not yet stored)
                reasons.append(f"endpoint {ep.id} is announcing its models")
                continue
            if ep.follows_engine and not ep.models:  # (nothing a frontend can route to)
                refused = len(ep.refused)
                why = (
                    f"the {refused} its engine lists were refused"
                    if refused
                    else "its engine lists none"
                )
                reasons.append(f"endpoint {ep.id} announces no model ({why})")
            deadline = asyncio.timeout(ENGINE_CHECK_TIMEOUT)
            try:
                async with deadline:
                    await ep.engine.check_health()
            except Exception as exc:
                why = f"unhealthy: {exc}"
                if deadline.expired():  # (a hang: the TimeoutError's text is empty)
                    why = f"did not answer its check within {ENGINE_CHECK_TIMEOUT:g}s"
                reasons.append(f"endpoint {ep.id}: engine {ep.engine.name} {why}")
            endpoints.append(_endpoint_body(ep, await self._models_shown(ep)))
        lease = self.registrations.lease
        body = {
            "status": "unavailable" if reasons else "ok",
            "reasons": reasons,
            "instance_id": None if lease is None else f"{lease.id:x}",
            "endpoints": endpoints,
        }
        return not reasons, body

    async def _models_shown(self, ep: Endpoint) -> list[str | None]:
        changes = self.registrations.models_changed
        shown = self._shown.get(ep.id)
        if shown is None or shown[0] != changes:
            shown = (changes, await first_by_name(ep.models, MODELS_SHOWN))
            self._shown[ep.id] = shown
        return shown[1]


def _endpoint_body(ep: Endpoint, shown: list[str | None]) -> dict[str, Any]:
    """What `/health` says of a serving endpoint: its URL, requests in flight, how many
    models it announces and the `shown` ones, and the models its engine lists that could
    not be announced (not a reason to be unhealthy: the others are announced)."""
    refused = itertools.islice(ep.refused.items(), REFUSED_SHOWN)
    models = [(suffix, ep.models.get(suffix)) for suffix in shown]
    return {
        "endpoint": str(ep.id),
        "url": ep.url,
        "in_flight": ep.in_flight,
        "models_refused": len(ep.refused),
        "refused": [{"name": quoted(name), "reason": why} for name, (_, why) in refused],
        "models_announced": len(ep.models),
        "models": [
            {
                "name": att.card.display_name,
                "suffix": suffix,
                "mdcsum": att.card.mdcsum,
                "taints": list(att.card.taints),
            }
            for suffix, att in models
            if att is not None
        ],
    }
