"""A virtual model's targets as the request path picks them: a `fleet` target (a model of the
registry, routed as a request for it would be) or a `url` target (an external provider behind
one pooled `Upstream`, `None` while it cannot be used). The `RouteTable` (`virtual.py`) makes
them from a route's targets and shares a provider's upstreams between them."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from shoal.cards import ModelType
from shoal.discovery import UrlTarget
from shoal.frontend.http.upstream import Upstream
from shoal.frontend.registry.registry import Model, Registry
from shoal.frontend.registry.router import Router
from shoal.urls import redact_url


@dataclass(eq=False, slots=True)
class FleetChoice:
    """A `fleet` target: requests go where a request for `served` would."""

    served: str
    weight: int
    registry: Registry

    def model(self, kind: ModelType) -> Model | None:
        model = self.registry.models.get(self.served)
        return None if model is None else model.for_kind(kind)

    def pick(
        self, kind: ModelType, router: Router, prompt: str | None, exclude: Collection[Upstream]
    ) -> Upstream | None:
        model = self.registry.models.get(self.served)
        if model is not None:
            model = model.for_kind(kind)
        if model is None or not model.routable_sets:
            return None
        return router.choose(model, prompt, exclude)

    def candidates(self, kind: ModelType) -> Iterable[Upstream]:
        model = self.model(kind)
        if model is None:
            return ()
        return (u for ws in model.routable_sets for u in ws.routable)

    @property
    def serving(self) -> bool:
        model = self.registry.models.get(self.served)
        return model is not None and model.serving

    def instances(self) -> Iterable[Upstream]:
        """Every instance that can take a request of some kind now."""
        model = self.registry.models.get(self.served)
        return () if model is None else (u for ws in model.routable_sets for u in ws.routable)

    def accepts(self, kind: ModelType) -> bool:
        model = self.registry.models.get(self.served)
        return model is not None and kind in model.model_types

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "fleet",
            "model": self.served,
            "weight": self.weight,
            "serving": self.serving,
        }


@dataclass(eq=False, slots=True)
class UrlChoice:
    """A `url` target: an external provider; `upstream` is None while it cannot be used
    (`error` says why: a missing secret, a URL the frontend cannot reach)."""

    served: str
    weight: int
    target: UrlTarget
    upstream: Upstream | None
    error: str | None = None
    secret_missing: bool = False  # the only reason it cannot be used: resolved again later
    # The upstreams of every target on its key (its base URL and secret), its own too: a 401
    # refuses them all (`RouteTable._keys`, shared).
    on_key: Collection[Upstream] = ()

    def pick(
        self, kind: ModelType, router: Router, prompt: str | None, exclude: Collection[Upstream]
    ) -> Upstream | None:
        upstream = self.upstream
        return None if upstream is None or upstream in exclude else upstream

    def candidates(self, kind: ModelType) -> Iterable[Upstream]:
        return () if self.upstream is None else (self.upstream,)

    @property
    def serving(self) -> bool:
        return self.upstream is not None

    def instances(self) -> Iterable[Upstream]:
        return () if self.upstream is None else (self.upstream,)

    def accepts(self, kind: ModelType) -> bool:
        return self.upstream is not None  # a provider's kinds are not known: it answers

    def describe(self) -> dict[str, Any]:
        upstream = self.upstream
        return {
            "kind": "url",
            "base_url": redact_url(self.target.base_url),
            "model": self.served,
            "weight": self.weight,
            "secret": self.target.secret,
            "provider": self.target.provider,
            "serving": upstream is not None,
            "inhibited": upstream is not None and upstream.inhibited,
            "error": self.error,
        }


Choice = FleetChoice | UrlChoice
