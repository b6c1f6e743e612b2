"""`DiscoveryFeed`: how the membership watch reads discovery, in two operations it counts on.

`open(query, revision)` opens one watch over a scope (its instances and its model cards)
starting after a store revision read before anything is read (`revision()`; one read can
serve many scopes opened together); `read(query)` reads a snapshot of
the scope's routable models; `forget(query)` drops what was kept for the next read of a
scope that closed. Tests subclass it to count the first two.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from shoal.discovery import Discovery, ModelInstance, Query
from shoal.discovery.keys import ROOT
from shoal.store import Delete, Put, Resync

REVISION_PROBE = ROOT + "membership/revision-probe"
"""A key nobody writes: reading it costs one small read and returns the store revision."""

Change = Put | Delete | Resync


class ScopeWatch:
    """One open watch over a scope: its instances and model cards merged into one stream."""

    def __init__(self, discovery: Discovery, query: Query, start_revision: int) -> None:
        self.query = query
        self.start_revision = start_revision
        self._queue: asyncio.Queue[Change | BaseException | None] = asyncio.Queue()
        store = discovery.store
        self._tasks = [
            asyncio.create_task(self._pump(store.watch(prefix, start_revision)))
            for prefix in (query.instances_prefix, query.models_prefix)
        ]

    async def _pump(self, stream: AsyncIterator[Change]) -> None:
        try:
            async for change in stream:
                self._queue.put_nowait(change)
            self._queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._queue.put_nowait(exc)

    def __aiter__(self) -> AsyncIterator[Change]:
        return self._changes()

    async def _changes(self) -> AsyncIterator[Change]:
        """Every change; ends when either store watch ends, raises what one raised."""
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task


class DiscoveryFeed:
    """Watches and snapshot reads of discovery for the membership watch."""

    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery

    async def revision(self) -> int:
        """The store's current revision (one small read)."""
        return (await self.discovery.store.get_prefix(REVISION_PROBE)).revision

    async def open(self, query: Query, revision: int | None = None) -> ScopeWatch:
        """A watch of `query` from `revision` + 1 (a revision read before any snapshot read
        of the scope; the store's current one when None): whatever a later snapshot read
        misses, this watch delivers."""
        if revision is None:
            revision = await self.revision()
        return ScopeWatch(self.discovery, query, revision + 1)

    async def read(self, query: Query) -> list[ModelInstance]:
        """The routable models of `query` now."""
        return await self.discovery.list(query)

    def forget(self, query: Query) -> None:
        """`query` is no longer read: drop what discovery keeps to list it again."""
        self.discovery.forget(query)
