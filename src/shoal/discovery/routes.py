"""Virtual-model routes: what a public model name resolves to, kept in the store.

The models controller (`shoal.catalog`) resolves each virtual model of the catalog into
weighted targets and publishes them at `shoal/v1/routes/{workspace}/{name}`; every frontend
watches that prefix like any other discovery prefix and never calls the catalog. A target is
either a model served by the fleet (a name announced in discovery) or an OpenAI-compatible
`url` provider (its base URL, the model name it serves, and the *name* of the secret that
authenticates to it: secret values never enter the store).

Routes are desired state, not liveness: they are written without a lease, so they outlive
the controller that wrote them, and removed when their virtual model goes away. Names are
quoted in keys, `=` escaping what a key cannot hold (`org/model` is `org=2Fmodel`). Unknown fields are ignored, so a newer
controller's route stays readable by an older frontend; known fields are validated strictly.
"""

from __future__ import annotations

import urllib.parse
from typing import Annotated

import msgspec

from shoal.bounds import TooDeep, check_json_depth
from shoal.discovery.keys import ROOT, quoted
from shoal.store import MAX_KEY_BYTES, Store
from shoal.urls import redact_url

ROUTES = ROOT + "routes/"

MAX_TARGETS = 256
"""Targets of one route, at most: a frontend resolves a route's targets in one turn of its
event loop (a provider's connection pool each), so a longer one is refused as malformed."""

Weight = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class RouteError(ValueError):
    """A route key or value that is not valid; the message names what is wrong."""


class FleetTarget(msgspec.Struct, frozen=True, tag="fleet", tag_field="kind"):
    """A model served by the fleet: requests go where a request for `model` would."""

    model: NonEmpty
    weight: Weight = 1


class UrlTarget(msgspec.Struct, frozen=True, tag="url", tag_field="kind"):
    """An external OpenAI-compatible server: `base_url` ends before `/chat/completions`
    (e.g. `https://api.example.com/v1`); `model` is the name it serves; `secret`, when set,
    names the bearer token the frontend resolves from `SHOAL_SECRET_<NAME>` or its secrets
    directory."""

    base_url: NonEmpty  # no query: refused by `decode_route` (a key belongs in a secret)
    model: NonEmpty
    weight: Weight = 1
    secret: str | None = None
    provider: str = ""  # `workspace/name` of the catalog provider, for people


Target = FleetTarget | UrlTarget


class Route(msgspec.Struct, frozen=True):
    """Virtual model `name` of `workspace` and its targets; a request picks one by weight.
    No target (or only zero weights) means the name is known but has nowhere to go."""

    workspace: NonEmpty
    name: NonEmpty
    targets: Annotated[tuple[Target, ...], msgspec.Meta(max_length=MAX_TARGETS)] = ()

    @property
    def key(self) -> str:
        return route_key(self.workspace, self.name)

    def to_json(self) -> bytes:
        return _encoder.encode(self)


_encoder = msgspec.json.Encoder(order="deterministic")
_decoder = msgspec.json.Decoder(Route)


def route_key(workspace: str, name: str) -> str:
    return f"{ROUTES}{_quote(workspace)}/{_quote(name)}"


def parse_route_key(key: str) -> tuple[str, str]:
    """(workspace, name) of a route key; `RouteError` if it is not one."""
    if len(key) > MAX_KEY_BYTES:  # (another writer's: etcd takes keys of 1.5 MiB)
        raise RouteError(f"route key of {len(key):,} characters, over the store's bound")
    if not key.startswith(ROUTES):
        raise RouteError(f"not a route key: {key!r}")
    parts = key[len(ROUTES) :].split("/")
    if len(parts) != 2 or not all(parts):
        raise RouteError(f"malformed route key {key!r}: expected {ROUTES}WORKSPACE/NAME")
    workspace, name = (urllib.parse.unquote(p.replace("=", "%")) for p in parts)
    if route_key(workspace, name) != key:
        raise RouteError(f"route key {key!r} is not canonical")
    return workspace, name


def decode_route(key: str, value: bytes) -> Route:
    """The route stored at `key`; `RouteError` naming the problem if it does not fit (nested
    deeper than `shoal.bounds.MAX_DEPTH`, more than `MAX_TARGETS` targets, or a `url` target
    whose base URL has a query or a fragment, included)."""
    workspace, name = parse_route_key(key)
    try:
        check_json_depth(value)
        route = _decoder.decode(value)
    except (msgspec.ValidationError, msgspec.DecodeError, TooDeep) as exc:
        raise RouteError(f"invalid route at {key}: {exc}") from None
    if (route.workspace, route.name) != (workspace, name):
        raise RouteError(f"route at {key} names {quoted(route.workspace)}/{quoted(route.name)}")
    for target in route.targets:
        if isinstance(target, UrlTarget) and ("?" in target.base_url or "#" in target.base_url):
            raise RouteError(
                f"invalid route at {key}: base URL {redact_url(target.base_url)!r} has a query "
                "or a fragment, which is never sent to a provider (a key belongs in a secret)"
            )
    return route


async def publish_route(store: Store, route: Route) -> bool:
    """Write `route` unless the store already holds exactly it; True if written."""
    data = route.to_json()
    held = await store.get(route.key)
    if held is not None and held.value == data:
        return False
    await store.put(route.key, data)
    return True


async def delete_route(store: Store, workspace: str, name: str) -> None:
    await store.delete(route_key(workspace, name))


def _quote(segment: str) -> str:
    if not segment:
        raise RouteError("route workspace and name must not be empty")
    # Store keys allow letters, digits and ._-:@+= : other bytes are quoted, `=` the escape.
    return urllib.parse.quote(segment, safe="._-:@+").replace("%", "=")
