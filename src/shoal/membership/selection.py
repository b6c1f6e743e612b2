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

    The revision is a hash of the canonical content: the same namespaces in any order or
    formatting have the same revision.
    """

    namespaces: frozenset[str]
    revision: str
    watch_all: bool = False

    @classmethod
    def of(cls, namespaces: Iterable[str], *, watch_all: bool = False) -> Selection:
        names = frozenset(namespaces)
        canonical = msgspec.json.encode({"namespaces": sorted(names), "watch_all": watch_all})
        return cls(names, hashlib.sha256(canonical).hexdigest()[:16], watch_all)


class Source(Protocol):
    """Yields a complete selection each time it changes, or a `SourceError` when it cannot."""

    def selections(self) -> AsyncIterator[Selection | SourceError]: ...
