"""`DiscoverySource`: namespaces named in the configuration, or every namespace in discovery.

Its rules, checked when it is built so a bad configuration is refused at start:
`namespaces` (a list) or `watch_all`, not both and not neither; each endpoint prefix is
`ns`, `ns.component` or `ns.component.endpoint`, inside a listed namespace when a list is
given. With `watch_all` the membership watch derives the namespaces from the models in
discovery (one watch over everything).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from shoal.discovery import EndpointId, Query
from shoal.discovery.keys import check_name
from shoal.membership.errors import ConfigError, SourceError
from shoal.membership.selection import Selection


@dataclass(frozen=True, slots=True)
class EndpointPrefix:
    """`ns`, `ns.component` or `ns.component.endpoint`: which endpoints a namespace offers."""

    namespace: str
    component: str | None = None
    endpoint: str | None = None

    @classmethod
    def parse(cls, text: str) -> EndpointPrefix:
        parts = text.split(".")
        if not 1 <= len(parts) <= 3:
            raise ConfigError(
                f"endpoint prefix {text!r}: expected ns, ns.component or ns.component.endpoint"
            )
        for kind, part in zip(("namespace", "component", "endpoint"), parts, strict=False):
            try:
                check_name(kind, part)
            except ValueError as exc:
                raise ConfigError(f"endpoint prefix {text!r}: {exc}") from None
        return cls(*parts)

    def matches(self, endpoint: EndpointId) -> bool:
        return (
            endpoint.namespace == self.namespace
            and self.component in (None, endpoint.component)
            and self.endpoint in (None, endpoint.endpoint)
        )

    @property
    def query(self) -> Query:
        return Query(self.namespace, self.component, self.endpoint)

    def __str__(self) -> str:
        return ".".join(p for p in (self.namespace, self.component, self.endpoint) if p)


class DiscoverySource:
    """A fixed selection (`namespaces`) or "every namespace in discovery" (`watch_all`)."""

    def __init__(
        self,
        namespaces: Iterable[str] | None = None,
        *,
        watch_all: bool = False,
        endpoint_prefixes: Iterable[str] = (),
    ) -> None:
        listed = None if namespaces is None else tuple(namespaces)
        if listed is not None and watch_all:
            raise ConfigError("discovery source: give `namespaces` or `watch_all`, not both")
        if listed is None and not watch_all:
            raise ConfigError("discovery source: give `namespaces` (a list) or `watch_all`")
        for name in listed or ():
            try:
                check_name("namespace", name)
            except ValueError as exc:
                raise ConfigError(f"discovery source: {exc}") from None
        if listed is not None and len(set(listed)) != len(listed):
            raise ConfigError("discovery source: `namespaces` lists a namespace twice")
        self.endpoint_prefixes = tuple(EndpointPrefix.parse(p) for p in endpoint_prefixes)
        for prefix in self.endpoint_prefixes:
            if listed is not None and prefix.namespace not in listed:
                raise ConfigError(
                    f"discovery source: endpoint prefix {str(prefix)!r} is outside the listed "
                    f"namespaces (each prefix must be inside a listed namespace)"
                )
        self.selection = Selection.of(listed or (), watch_all=watch_all)

    async def selections(self) -> AsyncIterator[Selection | SourceError]:
        yield self.selection
        await asyncio.Event().wait()  # a fixed configuration never changes
