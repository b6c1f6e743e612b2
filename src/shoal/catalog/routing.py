"""Virtual models resolved into routes, and the routes published to the discovery store.

A virtual model's targets (or its `default_model`, weight 1, when it lists none) are model
entities; each entity is served by the providers linked to it that list it in their
`served_models`. A `fleet` provider gives a `FleetTarget` (the served name, routed by the
frontends like any discovered model); a `url` provider gives a `UrlTarget` (its base URL,
served name and secret name). An entity served by two providers gives two targets, each with
the entity's weight. Publishing compares with what the store holds and writes only the
routes that differ, deleting those of virtual models that are gone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shoal.catalog.resources import Model, Provider, VirtualModel
from shoal.discovery.routes import (
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
from shoal.store import Store


def resolve(
    workspace: str,
    virtual_models: Iterable[VirtualModel],
    entity: Callable[[str], Model | None],
    providers: dict[str, Provider],
) -> list[Route]:
    """The route of each virtual model; `providers` by `"workspace/name"`."""
    routes: list[Route] = []
    for vm in virtual_models:
        wanted = [(t.model_entity, t.weight) for t in vm.targets] or [(vm.default_model, 1)]
        targets: list[Target] = []
        for name, weight in wanted:
            found = entity(name)
            for ref in found.providers if found is not None else ():
                provider = providers.get(ref)
                if provider is not None and (target := _target(provider, ref, name, weight)):
                    targets.append(target)
        routes.append(Route(workspace, vm.name, tuple(targets)))
    return routes


def _target(provider: Provider, ref: str, entity: str, weight: int) -> Target | None:
    served = next(
        (s.served_model_name for s in provider.served_models or () if s.model_entity == entity),
        None,
    )
    if served is None:
        return None
    if provider.type == "fleet":
        return FleetTarget(served, weight)
    assert provider.base_url is not None
    return UrlTarget(provider.base_url, served, weight, provider.auth_secret, ref)


def routes_prefix(workspace: str) -> str:
    return route_key(workspace, "-").rsplit("/", 1)[0] + "/"


async def publish(store: Store, workspace: str, routes: list[Route]) -> tuple[int, int]:
    """Make the store hold exactly `routes` for `workspace`: (written, deleted)."""
    held = await store.get_prefix(routes_prefix(workspace))
    held_values = {kv.key: kv.value for kv in held.items}
    written = 0
    for route in routes:
        if held_values.get(route.key) != route.to_json() and await publish_route(store, route):
            written += 1
    wanted = {route.key for route in routes}
    deleted = 0
    for key in sorted(held_values.keys() - wanted):
        try:
            _, name = parse_route_key(key)
        except RouteError:  # not a route key: not ours to judge, but in our prefix all the same
            await store.delete(key)
        else:
            await delete_route(store, workspace, name)
        deleted += 1
    return written, deleted
