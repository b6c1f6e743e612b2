"""The published view: the endpoint instances in force, and the status of the membership."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shoal.discovery import EndpointId, ModelInstance, Query
from shoal.slices import ENCODED_PER_SLICE, encode_in_slices

log = logging.getLogger("shoal.membership.watch")  # (the watch's messages)

EndpointRef = tuple[EndpointId, int]
"""An endpoint instance: where it serves and its instance id (the id of its lease)."""


@dataclass(frozen=True, slots=True)
class EndpointView:
    """One endpoint instance and the models it serves.

    `generation` changes only when this endpoint changes (a card joins or leaves, its taints
    or its instance change): a consumer skips the endpoints whose generation it has seen.
    """

    endpoint: EndpointId
    instance_id: int
    models: tuple[ModelInstance, ...]
    generation: int

    @property
    def namespace(self) -> str:
        return self.endpoint.namespace

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(sorted({str(m.card.role) for m in self.models}))

    @property
    def taints(self) -> tuple[str, ...]:
        return tuple(sorted({t for m in self.models for t in m.card.taints}))

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.endpoint.namespace,
            "component": self.endpoint.component,
            "endpoint": self.endpoint.endpoint,
            "instance_id": f"{self.instance_id:x}",
            "models": [
                {"name": m.card.display_name, "suffix": m.key.suffix, "mdcsum": m.mdcsum}
                for m in self.models
            ],
            "roles": list(self.roles),
            "taints": list(self.taints),
            "generation": self.generation,
        }


@dataclass(frozen=True, slots=True)
class Membership:
    """The namespaces in force, the queries a consumer watches for them, and their endpoints.

    `scopes` maps each namespace in force to its discovery queries: the namespace itself, or
    the endpoint prefixes inside it when the source restricts it.
    """

    revision: str | None
    scopes: Mapping[str, tuple[Query, ...]]
    endpoints: Mapping[EndpointRef, EndpointView]
    version: int = 0
    connection_revision: str | None = None

    @property
    def namespaces(self) -> frozenset[str]:
        return frozenset(self.scopes)

    def same_as(self, other: Membership) -> bool:
        return (
            self.revision == other.revision
            and self.connection_revision == other.connection_revision
            and self.scopes == other.scopes
            and self.endpoints == other.endpoints
        )

    async def json(self) -> bytes:
        """`to_dict()` as JSON, kept until the view changes (a view is never changed in
        place: a new one replaces it). 10,000 endpoints were ~60 ms of Python, which held the
        loop of whoever served `/v1/membership`: the dicts are made in a thread (Python code:
        the loop takes the GIL back every switch interval), and encoded on the loop a slice
        at a time (msgspec encodes in one C call holding the GIL: in a thread the whole view
        held the loop all the same, ~6 ms at 10,000 endpoints, ~33 ms at 50,000)."""
        return await _view_json(self)

    def to_dict(self) -> dict[str, Any]:
        shown: dict[str, Any] = {
            "revision": self.revision,
            "version": self.version,
            "namespaces": sorted(self.scopes),
            "endpoints": [self.endpoints[ref].to_dict() for ref in sorted(self.endpoints)],
        }
        if self.connection_revision is not None:  # (only sources that give one)
            shown["connection_revision"] = self.connection_revision
        return shown


EMPTY = Membership(None, {}, {})

# The last view asked for, and its JSON being made or made: requests that come together
# for a new view share one encoding (each made its own: 30 of them at 10,000 endpoints held
# the GIL in threads for 3 s).
_encoded: tuple[Membership, asyncio.Future[bytes]] | None = None


async def _view_json(view: Membership) -> bytes:
    global _encoded
    last = _encoded
    loop = asyncio.get_running_loop()
    if last is None or last[0] is not view or last[1].get_loop() is not loop:
        made = loop.create_task(_encoded_view(view), name="membership-view-json")
        last = _encoded = (view, made)
    return await asyncio.shield(last[1])  # (a request that leaves cancels only its wait)


async def _encoded_view(view: Membership) -> bytes:
    """`msgspec.json.encode(view.to_dict())`, the same bytes, its endpoints encoded a slice
    at a time (`encode_in_slices`), then let go of a slice at a time (50,000 endpoints' dicts
    freed at once held the loop ~20 ms)."""
    shown = await asyncio.to_thread(view.to_dict)
    endpoints: list[Any] = shown["endpoints"]
    shown["endpoints"] = msgspec.Raw(await encode_in_slices(endpoints))
    while endpoints:
        await asyncio.sleep(0)
        del endpoints[-ENCODED_PER_SLICE:]
    return msgspec.json.encode(shown)


@dataclass
class MembershipStatus:
    """Whether the selection asked for is the one in force.

    `desired_revision`: the source's last valid selection; `applied_revision`: the selection
    whose watches are all set up (and `connection_revision`, the one it carries); `count`: namespaces in force; `last_error`: the latest
    source or watch failure, None once everything works again.
    """

    desired_revision: str | None = None
    applied_revision: str | None = None
    connection_revision: str | None = None
    count: int = 0
    last_error: str | None = None
    errors: dict[str, str] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        shown: dict[str, Any] = {
            "desired_revision": self.desired_revision,
            "applied_revision": self.applied_revision,
            "count": self.count,
            "last_error": self.last_error,
        }
        if self.connection_revision is not None:  # (only sources that give one)
            shown["connection_revision"] = self.connection_revision
        return shown

    def fail(self, what: str, message: str, kept: str) -> None:
        """Record `what`'s error (`kept`: what stays in force); logged once per distinct
        message, not on every tick."""
        if self.errors.get(what) != message:
            log.warning("membership: %s (%s)", message, kept)
        self.errors.pop(what, None)
        self.errors[what] = message
        self.last_error = message

    def clear(self, what: str) -> None:
        """`what` works again: `last_error` is the latest error left, or None."""
        if self.errors.pop(what, None) is not None:
            log.info("membership: %s recovered", what)
            self.last_error = next(reversed(self.errors.values()), None)
