"""Virtual models: the routes of this frontend's workspaces, resolved for the request path.

The models controller publishes each virtual model's targets at
`shoal/v1/routes/{workspace}/{name}` (`shoal.discovery.routes`); the `RouteWatcher` feeds
them to the `RouteTable`, which keeps each workspace's `VirtualModel`s by name, what the
proxy looks up (`lookup`). A request picks one target by weight (`targets.py`). A `fleet`
target is a model of the registry (routed as a request for it would be: its worker sets, the
routing policy, inhibition); a `url` target is an external provider behind one pooled
`Upstream` (HTTPS or HTTP), whose
bearer token comes from the frontend's own secrets. Targets that differ only in the model
they name (gpt-4o and gpt-4o-mini on one key) have an `Upstream` each: a failure excludes
and inhibits the target that failed, not its neighbour at the same base URL (a 403 too: the
key denied that model); but a 401 refuses the key itself, and inhibits every target on it
(`UrlChoice.on_key`: the same base URL and secret).

Names: a virtual model wins over a discovered model of the same name (logged once per name):
the route is what an operator declared, and the controller's passthrough virtual models are
named like the fleet models they point at. A fleet target always names a discovered model,
never another virtual model, so routes do not chain. A key belongs to its workspace: a request
made with one sees that workspace's virtual models alone (`by_workspace`); a request without a
team's key sees every served workspace's (`models`), the first in `--workspace` order winning
a name several define. `lookup` is the one place a request's name is resolved.

A malformed route is reported in `skipped` and never hides a valid one: a key that held a
valid route keeps it until the key is deleted or a valid value replaces it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import itertools
import logging
import random
import ssl
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from shoal.bounds import first_listed
from shoal.cards import ModelType
from shoal.discovery import FleetTarget, Route, RouteError, UrlTarget, decode_route, route_key
from shoal.discovery.routes import parse_route_key
from shoal.frontend.http.upstream import Upstream
from shoal.frontend.registry.registry import Model, Registry
from shoal.frontend.registry.router import Router
from shoal.frontend.virtual import masking
from shoal.frontend.virtual.secrets import SecretError, Secrets
from shoal.frontend.virtual.targets import Choice, FleetChoice, UrlChoice
from shoal.store import KeyValue
from shoal.urls import redact_url

log = logging.getLogger(__name__)

_provider_ids = itertools.count(1)

SLICE_ROUTES = 100  # routes a replace (or a refresh) handles between turns of the event loop
SLICE_BYTES = 16 * 1024  # ... or bytes of route values (a route of 256 url targets is ~25 KiB)
DESCRIBED = 100  # virtual models `describe` lists (it counts them all), as `/health` does
DESCRIBED_TARGETS = 16
"""Targets a virtual model's `describe` lists, in its route's order (`targets_total` counts
them all): 100 routes of 256 targets each, described whole, held the loop 40-80 ms."""


class VirtualModel:
    """One virtual model: its route and its targets, with the weights precomputed."""

    def __init__(self, route: Route, choices: Sequence[Choice]) -> None:
        self.route = route
        self.name = route.name
        self.workspace = route.workspace
        self.choices = tuple(choices)
        self.weighted = tuple(c for c in self.choices if c.weight > 0)
        # a target serves it under another name: a request's body is rewritten for it
        self.renames = any(c.served != self.name for c in self.weighted)
        # no provider among its targets: a key's stream may ask for the usage (`Proxy.ask_usage`)
        self.fleet_only = all(isinstance(c, FleetChoice) for c in self.weighted)
        self._cum: list[int] = list(itertools.accumulate(c.weight for c in self.weighted))

    @property
    def serving(self) -> bool:
        """A target with weight can take requests now: listed by `/v1/models`."""
        return any(c.serving for c in self.weighted)

    def accepts(self, kind: ModelType) -> bool:
        """A target with weight takes requests of `kind` (a provider takes every kind)."""
        return any(choice.accepts(kind) for choice in self.weighted)

    def staged(self, kind: ModelType) -> tuple[Model, str] | None:
        """When this request goes to a fleet model served in two stages now (`Model.stages`):
        that model, as requests of `kind` see it, and its name. None when it goes elsewhere
        (`choose` then picks among the targets served whole and the providers). With several
        targets, one is drawn by weight among those that can take the request now."""
        staged: dict[int, Model] = {}
        for i, choice in enumerate(self.weighted):
            if isinstance(choice, FleetChoice):
                model = choice.model(kind)
                if model is not None and model.stages is not None:
                    staged[i] = model
        if not staged:
            return None
        if len(self.weighted) == 1:  # an alias: the common case
            return staged[0], self.weighted[0].served
        weights = [
            c.weight if i in staged or any(not u.inhibited for u in c.candidates(kind)) else 0
            for i, c in enumerate(self.weighted)
        ]
        point = random.random() * sum(weights)
        for i, weight in enumerate(weights):
            if weight and point < weight:
                model = staged.get(i)
                return None if model is None else (model, self.weighted[i].served)
            point -= weight
        return None

    @property
    def live_instances(self) -> int:
        """Instances and providers its targets with weight can send requests to now."""
        return len({u for c in self.weighted for u in c.instances()})

    def choose(
        self, kind: ModelType, router: Router, prompt: str | None, exclude: Collection[Upstream]
    ) -> tuple[Upstream, str] | None:
        """An instance or provider for a request of `kind`, and the name it serves the
        model as; inhibited ones only when nothing else is left. None: nowhere to go."""
        weighted = self.weighted
        if len(weighted) == 1:  # an alias: the common case
            choice = weighted[0]
            target = choice.pick(kind, router, prompt, exclude)
            return None if target is None else (target, choice.served)
        if not weighted:
            return None
        if not exclude and not Upstream.any_inhibited():
            choice = weighted[bisect.bisect_right(self._cum, random.random() * self._cum[-1])]
            target = choice.pick(kind, router, prompt, exclude)
            if target is not None:
                return target, choice.served
        return self._choose_around(kind, router, prompt, exclude)

    def _choose_around(
        self, kind: ModelType, router: Router, prompt: str | None, exclude: Collection[Upstream]
    ) -> tuple[Upstream, str] | None:
        """Weigh only the targets with an instance neither tried nor inhibited; else the
        untried instance whose inhibition ends first."""
        weights = [
            c.weight if any(u not in exclude and not u.inhibited for u in c.candidates(kind)) else 0
            for c in self.weighted
        ]
        point = random.random() * sum(weights)
        for choice, weight in zip(self.weighted, weights, strict=True):
            if weight and point < weight:
                target = choice.pick(kind, router, prompt, exclude)
                if target is not None:
                    return target, choice.served
                break
            point -= weight
        best: tuple[Upstream, str] | None = None
        for choice in self.weighted:
            target = choice.pick(kind, router, prompt, exclude)
            if target is not None and (
                best is None or target.inhibited_until < best[0].inhibited_until
            ):
                best = (target, choice.served)
        return best

    def untried(self, kind: ModelType, exclude: Collection[Upstream]) -> bool:
        """Whether an instance or provider not in `exclude` is left (a 5xx is worth a retry)."""
        return any(u not in exclude for c in self.weighted for u in c.candidates(kind))

    def describe(self, targets: int = DESCRIBED_TARGETS) -> dict[str, Any]:
        return {
            "workspace": self.workspace,
            "name": self.name,
            "serving": self.serving,
            "targets": [c.describe() for c in self.choices[:targets]],
            "targets_total": len(self.choices),
        }


class LiveInstances(Mapping[str, int]):
    """Per model name, discovered (`models`) and virtual (`virtual`: a virtual model wins a
    name), the instances and providers it can send requests to now, each counted when read:
    `/metrics` reads them a slice at a time (all of them at once, a set per virtual model
    over its targets' instances, took 16-18 ms at 10,000 routes)."""

    __slots__ = ("models", "virtual")

    def __init__(self, models: Mapping[str, Model], virtual: Mapping[str, VirtualModel]) -> None:
        self.models = models
        self.virtual = virtual

    def __getitem__(self, name: str) -> int:
        vm = self.virtual.get(name)
        return self.models[name].live_instances if vm is None else vm.live_instances

    def __contains__(self, name: object) -> bool:
        return name in self.virtual or name in self.models

    def __iter__(self) -> Iterator[str]:
        virtual = self.virtual
        return itertools.chain(virtual, itertools.filterfalse(virtual.__contains__, self.models))

    def names(self) -> list[str]:
        """Every name as one copy of each table's keys, in C, where a name in both is listed
        twice (`/metrics` drops the second as it sorts them a slice at a time): a third of
        the cost of a unique listing (30,000 + 30,000 names: 3-5 ms against 13-17 ms)."""
        return [*self.virtual, *self.models]

    def __len__(self) -> int:
        return len(self.virtual) + len(self.models) - len(self.virtual.keys() & self.models.keys())


class RouteTable:
    """The virtual models of this frontend's workspaces, by name, as the proxy reads them.

    `by_workspace` holds each workspace's, what its keys see; `models` the view of a request
    without a team's key, each name the first workspace's that defines it (the same
    objects). Both are mutated in place; `version` is bumped by every change of what they
    hold, and `versions[workspace]` by every change of that workspace's, so what is derived
    from a view (its `/v1/models` listing) is made again only then. `skipped` holds the
    route keys whose value is not used, with the reason.
    """

    def __init__(
        self,
        registry: Registry,
        workspaces: Sequence[str] = ("default",),
        *,
        secrets: Secrets | None = None,
        tls: ssl.SSLContext | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        self.registry = registry
        self.workspaces = tuple(dict.fromkeys(workspaces))
        self.secrets = secrets or Secrets()
        self.tls = tls  # for HTTPS providers; None: the system's defaults, made when first needed
        self.connect_timeout = connect_timeout
        self.models: dict[str, VirtualModel] = {}
        self.by_workspace: dict[str, dict[str, VirtualModel]] = {ws: {} for ws in self.workspaces}
        self.routes: dict[str, dict[str, Route]] = {ws: {} for ws in self.workspaces}
        self.skipped: dict[str, str] = {}
        self.version = 0
        self.versions = dict.fromkeys(self.workspaces, 0)
        self.renaming = 0  # virtual models (of any workspace) with a target renaming the model
        # (base URL, secret, model) -> the target's upstream and how many choices hold it
        self._upstreams: dict[tuple[str, str | None, str], tuple[Upstream, int]] = {}
        # (base URL, secret) -> the upstreams of the targets on that key
        self._keys: dict[tuple[str, str | None], set[Upstream]] = {}
        self._clashes_logged: set[str] = set()
        self._shared_logged: set[str] = set()  # names several workspaces define (logged once)

    # -- changes (from the route watcher) ----------------------------------------------------

    def put(self, key: str, value: bytes) -> None:
        """A route key was written: take the route, or report it and keep the valid one."""
        try:
            route = decode_route(key, value)
        except RouteError as exc:
            self._skip(key, str(exc))
            return
        self.skipped.pop(key, None)
        held = self.routes.get(route.workspace)
        if held is None:
            return  # not a workspace of this frontend
        if held.get(route.name) != route:
            held[route.name] = route
            self._settle(route.workspace, route.name)

    def delete(self, key: str) -> None:
        self.skipped.pop(key, None)
        try:
            workspace, name = parse_route_key(key)
        except RouteError:
            return
        held = self.routes.get(workspace)
        if held is not None and held.pop(name, None) is not None:
            self._settle(workspace, name)

    async def replace(self, workspace: str, items: Iterable[KeyValue]) -> None:
        """The whole of `workspace` as a listing or a resync read it: what is not in it goes.
        The event loop runs between slices (`SLICE_ROUTES` routes or `SLICE_BYTES` of values):
        10,000 routes held it 212-429 ms in one go."""
        held = self.routes.get(workspace)
        if held is None:
            return
        seen: set[str] = set()
        keys: set[str] = set()
        routes = size = 0
        for kv in items:
            keys.add(kv.key)
            with contextlib.suppress(RouteError):
                seen.add(parse_route_key(kv.key)[1])
            self.put(kv.key, kv.value)
            routes, size = routes + 1, size + len(kv.value)
            if routes >= SLICE_ROUTES or size >= SLICE_BYTES:
                routes = size = 0
                await asyncio.sleep(0)
        for count, name in enumerate([n for n in held if n not in seen], 1):
            if held.pop(name, None) is not None:  # (a watch event may have taken it meanwhile)
                self._settle(workspace, name)
            if count % SLICE_ROUTES == 0:
                await asyncio.sleep(0)
        prefix = workspace_prefix(workspace)
        for key in [k for k in self.skipped if k.startswith(prefix) and k not in keys]:
            del self.skipped[key]

    async def refresh_secrets(self) -> None:
        """Resolve every provider's secret again (a rotated file, a variable set late): the
        files are read in a thread (3,000 of them held the loop 129 ms), each secret alone (one
        that fails to resolve keeps the value in use, and never stops the others)."""
        every = [vm for held in self.by_workspace.values() for vm in held.values()]
        missing = [c.target for vm in every for c in vm.choices
                   if isinstance(c, UrlChoice) and c.secret_missing]  # fmt: skip
        names = {secret for _, secret, _ in self._upstreams if secret is not None}
        names.update(t.secret for t in missing if t.secret is not None)
        values = await asyncio.to_thread(self._resolve_all, names)
        for (_, secret, _), (upstream, _) in list(self._upstreams.items()):
            value = values.get(secret) if secret is not None else None
            if value is not None:
                upstream.authorization = b"Bearer " + value.encode()
        stale = {(vm.workspace, vm.name) for vm in every for c in vm.choices
                 if isinstance(c, UrlChoice) and c.secret_missing
                 and c.target.secret is not None and values.get(c.target.secret) is not None}  # fmt: skip
        for count, (workspace, name) in enumerate(stale, 1):
            self._settle(workspace, name)
            if count % SLICE_ROUTES == 0:
                await asyncio.sleep(0)

    def _resolve_all(self, names: Iterable[str]) -> dict[str, str | None]:
        """Each secret's value, None for one that does not resolve (in a thread, which also
        makes the pattern that masks it in answers: the request path finds it made)."""
        values: dict[str, str | None] = {}
        for name in names:
            try:
                values[name] = value = self.secrets.resolve(name)
                masking.pattern(value.encode())
            except SecretError:
                values[name] = None
            except Exception:  # (one secret's surprise never stops the refresh of the others)
                log.exception("resolving secret %r failed", name)
                values[name] = None
        return values

    def close(self) -> None:
        for upstream, _ in self._upstreams.values():
            upstream.close()
        self._upstreams.clear()
        self._keys.clear()

    # -- reading -----------------------------------------------------------------------------

    def visible(self, workspace: str | None) -> Mapping[str, VirtualModel]:
        """The virtual models a request sees, by name: a key's, its `workspace`'s alone (a
        workspace not served: none); a request without a team's key (None), every served
        workspace's, the first in `--workspace` order winning a name."""
        return self.models if workspace is None else self.by_workspace.get(workspace, _NONE)

    def lookup(self, name: str, workspace: str | None) -> VirtualModel | None:
        """The virtual model a request for `name` goes to (see `visible`); None: no route of
        that name is visible to it (a discovered model of the name, if any, serves it)."""
        if workspace is None:  # (the request path: no call to `visible`)
            return self.models.get(name)
        held = self.by_workspace.get(workspace)
        return None if held is None else held.get(name)

    def version_of(self, workspace: str | None) -> int:
        """The version of what `visible(workspace)` holds (bumped by each change of it)."""
        return self.version if workspace is None else self.versions.get(workspace, 0)

    def shadows(self, name: str) -> bool:
        """A virtual model hides the discovered model `name` (logged once per name)."""
        if name not in self.models:
            return False
        if name not in self._clashes_logged and name in self.registry.models:
            self._clashes_logged.add(name)
            log.warning(
                "virtual model %r (workspace %r) shadows the discovered model of the same "
                "name: requests for %r follow the route",
                name, self.models[name].workspace, name,
            )  # fmt: skip
        return True

    def live_instances(self) -> LiveInstances:
        """Per model name, discovered and virtual, the instances and providers it can send
        requests to now, each counted when read."""
        return LiveInstances(self.registry.models, self.models)

    def describe(self, limit: int = DESCRIBED) -> dict[str, Any]:
        """The table for people and dashboards: the first `limit` virtual models by name, then
        workspace, of every workspace (`models_total` counts them all: 10,000 described held
        the loop 111 ms), each with its first `DESCRIBED_TARGETS` targets, and skipped routes."""
        every = self.by_workspace
        firsts = [(name, ws) for ws, held in every.items() for name in heapq.nsmallest(limit, held)]
        return {
            "workspaces": list(self.workspaces),
            "models_total": sum(map(len, every.values())),
            "models": [every[ws][name].describe() for name, ws in heapq.nsmallest(limit, firsts)],
            "skipped_total": len(self.skipped),
            "skipped": first_listed(self.skipped),
        }

    # -- resolving ---------------------------------------------------------------------------

    def _skip(self, key: str, reason: str) -> None:
        if self.skipped.get(key) != reason:
            log.error("%s; skipped (a valid route held at this key is kept)", reason)
        self.skipped[key] = reason

    def _settle(self, workspace: str, name: str) -> None:
        """Make `by_workspace[workspace][name]` the route `workspace` holds for `name`, and
        `models[name]` the first workspace's that defines `name`."""
        held = self.by_workspace[workspace]
        route, old = self.routes[workspace].get(name), held.get(name)
        if route is None and old is None:
            return
        if route is not None:
            held[name] = new = VirtualModel(route, [self._resolve(t) for t in route.targets])
            self.renaming += new.renames
        else:
            del held[name]
        if old is not None:
            self.renaming -= old.renames
            self._release(old)
        self.versions[workspace] += 1
        self.version += 1
        defined = [ws for ws, vms in self.by_workspace.items() if name in vms]
        if not defined:
            del self.models[name]
            self._clashes_logged.discard(name)
            self._shared_logged.discard(name)
            return
        if len(defined) < 2:
            self._shared_logged.discard(name)
        elif name not in self._shared_logged:  # (once: each workspace's passthroughs share names)
            self._shared_logged.add(name)
            log.info(
                "virtual model %r is defined in workspaces %s: %r wins for requests without a "
                "team's key (a key sees its own workspace's)", name, defined, defined[0],
            )  # fmt: skip
        self.models[name] = self.by_workspace[defined[0]][name]
        self.shadows(name)

    def _resolve(self, target: FleetTarget | UrlTarget) -> Choice:
        if isinstance(target, FleetTarget):
            return FleetChoice(target.model, target.weight, self.registry)
        key = (target.base_url, target.secret, target.model)
        held = self._upstreams.get(key)
        if held is not None:
            self._upstreams[key] = (held[0], held[1] + 1)
            on_key = self._keys[target.base_url, target.secret]
            return UrlChoice(target.model, target.weight, target, held[0], on_key=on_key)
        try:
            upstream = self._provider(target.base_url)
        except ValueError as exc:
            log.error(
                "virtual model target %s cannot be used: %s", redact_url(target.base_url), exc
            )
            return UrlChoice(target.model, target.weight, target, None, str(exc))
        try:
            token = None if target.secret is None else self.secrets.resolve(target.secret)
        except SecretError as exc:
            upstream.close()
            log.error(
                "virtual model target %s cannot be used: %s", redact_url(target.base_url), exc
            )
            return UrlChoice(target.model, target.weight, target, None, str(exc), True)
        if token is not None:
            upstream.authorization = b"Bearer " + token.encode()
            with contextlib.suppress(RuntimeError):  # (no loop running: made when first used)
                asyncio.get_running_loop().run_in_executor(None, masking.pattern, token.encode())
        self._upstreams[key] = (upstream, 1)
        on_key = self._keys.setdefault((target.base_url, target.secret), set())
        on_key.add(upstream)
        return UrlChoice(target.model, target.weight, target, upstream, on_key=on_key)

    def _provider(self, base_url: str) -> Upstream:
        if not base_url.isascii() or any(ch.isspace() or ord(ch) < 32 for ch in base_url):
            raise ValueError(f"base URL {redact_url(base_url)!r} is not a plain ASCII URL")
        if self.tls is None:
            self.tls = ssl.create_default_context()
        upstream = Upstream(
            next(_provider_ids),
            base_url,
            connect_timeout=self.connect_timeout,
            tls=self.tls,
            provider=True,
        )
        if upstream.authorization is not None:
            raise ValueError(f"base URL {upstream.address}: credentials belong in a secret")
        upstream.label = b"url:" + upstream.host_header  # x-shoal-instance of its answers
        return upstream

    def _release(self, vm: VirtualModel) -> None:
        for choice in vm.choices:
            if isinstance(choice, UrlChoice) and choice.upstream is not None:
                key = (choice.target.base_url, choice.target.secret, choice.target.model)
                held = self._upstreams.get(key)
                if held is None or held[0] is not choice.upstream:
                    continue
                if held[1] <= 1:
                    del self._upstreams[key]
                    held[0].close()
                    on_key = self._keys.get(key[:2])
                    if on_key is not None:
                        on_key.discard(held[0])
                        if not on_key:
                            del self._keys[key[:2]]
                else:
                    self._upstreams[key] = (held[0], held[1] - 1)


_NONE: Mapping[str, VirtualModel] = MappingProxyType({})  # a workspace not served: no route


def workspace_prefix(workspace: str) -> str:
    """The store prefix of `workspace`'s routes (with its trailing `/`)."""
    return route_key(workspace, "_").rpartition("/")[0] + "/"
