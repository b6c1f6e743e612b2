"""Virtual models resolved into routes, and the routes published to the discovery store.

A virtual model's targets (or its `default_model`, weight 1, when it lists none) are model
entities; each entity is served by the providers linked to it that list it in their
`served_models`. A `fleet` provider gives a `FleetTarget` (the served name, routed by the
frontends like any discovered model); a `url` provider gives a `UrlTarget` (its base URL,
served name and secret name). An entity served by two providers gives two targets, each with
the entity's weight. Publishing compares with what the store holds and writes only the
routes that differ, each on its own: a route that cannot be written (over the store's value
limit) is reported for its virtual model and never stops the others. A held route that no
route of the listing replaces is deleted only once its virtual model is known to be gone
(`gone(name)`, a read by name): nothing is deleted on the strength of one listing's absence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from shoal.catalog.resources import Model, Provider, VirtualModel
from shoal.discovery.keys import quoted
from shoal.discovery.routes import (
    MAX_TARGETS,
    FleetTarget,
    Route,
    RouteError,
    Target,
    UrlTarget,
    delete_route,
    parse_route_key,
    publish_route,
    route_key,
)
from shoal.store import InvalidKeyError, Store, StoreError

log = logging.getLogger(__name__)


SLICE = 500
"""Routes resolved, compared or reported between two yields to the event loop (and beats of
the controller's heartbeat): a pass over 10,000 virtual models never holds the loop for
all of them at once."""


def _nothing() -> None:
    return None


def unwatched(_what: str) -> AbstractContextManager[None]:
    """A `waiting_on` that marks nothing (no loop watches the caller)."""
    return contextlib.nullcontext()


Waiting = Callable[[str], AbstractContextManager[None]]
"""`HeartbeatMixin.waiting_on`: what a call to the store is made inside, so that a store every
replica shares, slow or gone, is reported as a wait on it, not as the loop stuck."""


async def pause(beat: Callable[[], None] = _nothing) -> None:
    """Between two slices: beat, and let the event loop run everything else."""
    beat()
    await asyncio.sleep(0)


async def resolve(
    workspace: str,
    virtual_models: Iterable[VirtualModel],
    entity: Callable[[str], Model | None],
    providers: dict[str, Provider],
    *,
    beat: Callable[[], None] = _nothing,
) -> list[Route]:
    """The route of each virtual model; `providers` by `"workspace/name"`. Linear in the
    routes and served models: each provider's served names are looked up in a dict made once
    (not scanned per route), and every `SLICE` routes the loop runs (`pause(beat)`)."""
    served: dict[str, dict[str, str]] = {}  # provider ref -> {entity: served name}
    routes: list[Route] = []
    for count, vm in enumerate(virtual_models, 1):
        wanted = [(t.model_entity, t.weight) for t in vm.targets] or [(vm.default_model, 1)]
        targets: list[Target] = []
        for name, weight in wanted:
            found = entity(name)
            for ref in found.providers if found is not None else ():
                provider = providers.get(ref)
                if provider is None:
                    continue
                names = served.get(ref)
                if names is None:
                    names = served[ref] = _served_names(provider)
                if (target := _target(provider, ref, names.get(name), weight)) is not None:
                    targets.append(target)
        routes.append(Route(workspace, vm.name, tuple(targets)))
        if count % SLICE == 0:
            await pause(beat)
    return routes


def _served_names(provider: Provider) -> dict[str, str]:
    """{entity: served name} of a provider; the first listed wins, as a scan would find."""
    names: dict[str, str] = {}
    for s in provider.served_models or ():
        names.setdefault(s.model_entity, s.served_model_name)
    return names


def _target(provider: Provider, ref: str, served: str | None, weight: int) -> Target | None:
    if served is None:
        return None
    if provider.type == "fleet":
        return FleetTarget(served, weight)
    assert provider.base_url is not None
    return UrlTarget(provider.base_url, served, weight, provider.auth_secret, ref)


def routes_prefix(workspace: str) -> str:
    return route_key(workspace, "-").rsplit("/", 1)[0] + "/"


@dataclass
class Published:
    """What one publish did: routes written and deleted, and those that failed (name → why)."""

    written: int = 0
    deleted: int = 0
    failed: dict[str, str] = field(default_factory=dict)


async def publish(
    store: Store,
    workspace: str,
    routes: list[Route],
    gone: Callable[[str], Awaitable[bool]],
    *,
    beat: Callable[[], None] = _nothing,
    guard: Callable[[], None] = _nothing,
    waiting_on: Waiting = unwatched,
) -> Published:
    """Make the store hold `routes` for `workspace`, and no route of a virtual model that
    `gone(name)` confirms is gone; one route's failure is in `failed`, not raised. The loop
    runs (`pause(beat)`) every `SLICE` routes compared, written or not. `guard` (the
    controller's leadership check, a clock read that raises to stop) is called before each
    write and each delete: 10,000 writes, or deletes each after a read of the catalog,
    outlast a leader's TTL, and a replica frozen mid-way (checked only every `SLICE`, it
    wrote up to 499 routes of its old listing over the new leader's once it ran again) must
    write nothing once it lapsed. Every store call is made `waiting_on` the store."""
    with waiting_on("the store"):
        held = await store.get_prefix(routes_prefix(workspace))
    held_values = {kv.key: kv.value for kv in held.items}
    done = Published()
    wanted: set[str] = set()  # (each route's key made once, in the slices: 10,000 at once
    guard()
    for count, route in enumerate(routes, 1):  # held the loop ~100 ms)
        if count % SLICE == 0:
            await pause(beat)
            guard()
        try:
            key = route.key
            wanted.add(key)
            if len(route.targets) > MAX_TARGETS:  # frontends would skip it as malformed
                raise RouteError(
                    f"{len(route.targets)} targets (its entities' providers), over "
                    f"{MAX_TARGETS}: give it fewer targets or its entities fewer providers"
                )
            data = route.to_json()
            if held_values.get(key) != data:
                guard()  # (a clock read: a replica frozen mid-slice writes nothing after)
                with waiting_on("the store"):
                    if await publish_route(store, route):
                        done.written += 1
        except (StoreError, RouteError, ValueError) as exc:  # this route only
            done.failed[route.name] = f"route not published: {exc}"
            log.warning("route %s/%s not published: %s", workspace, route.name, exc)
    for key in sorted(held_values.keys() - wanted):
        guard()
        try:
            _, name = parse_route_key(key)
        except RouteError:  # not a route key: not ours to judge, but in our prefix all the same
            try:
                with waiting_on("the store"):
                    await store.delete(key)
            except InvalidKeyError as exc:  # another writer's key no store of ours may delete
                done.failed[quoted(key)] = f"not deleted: {exc}"
                log.warning("routes of %s: %s not deleted: %s", workspace, quoted(key), exc)
                continue
            done.deleted += 1
            continue
        if await gone(name):
            guard()  # (the read took its time)
            with waiting_on("the store"):
                await delete_route(store, workspace, name)
            done.deleted += 1
    return done
