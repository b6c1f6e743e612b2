"""`Selection`: a complete set of namespaces from a source, and the `Source` interface."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from shoal.membership.errors import SourceError


@dataclass(frozen=True, slots=True)
class Selection:
    """The namespaces a source selects, or every namespace (`watch_all`), and its revision.

    The revision is the source's own when it gives one (a sources file's `revision`), else a
    hash of the canonical content: the same namespaces in any order or formatting have the
    same revision. `connection_revision` is opaque: a consumer that connects elsewhere (the
    KV relay, to NATS) connects again when it changes.
    """

    namespaces: frozenset[str]
    revision: str
    watch_all: bool = False
    connection_revision: str | None = None

    @classmethod
    def of(
        cls,
        namespaces: Iterable[str],
        *,
        watch_all: bool = False,
        revision: str | None = None,
        connection_revision: str | None = None,
    ) -> Selection:
        names = frozenset(namespaces)
        if revision is None:
            content: dict[str, object] = {"namespaces": sorted(names), "watch_all": watch_all}
            if connection_revision is not None:
                content["connection_revision"] = connection_revision
            revision = hashlib.sha256(msgspec.json.encode(content)).hexdigest()[:16]
        return cls(names, revision, watch_all, connection_revision)


class Source(Protocol):
    """Yields a complete selection each time it changes, or a `SourceError` when it cannot."""

    def selections(self) -> AsyncIterator[Selection | SourceError]: ...
