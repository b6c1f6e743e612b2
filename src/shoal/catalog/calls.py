"""`Calls`: the catalog client as the models controller uses it, beating after every call.

Liveness follows progress (`shoal.controllers.heartbeat`): each completed API call, and each
page of a list, is progress. A call that hangs beats nothing, so the loop that made it is
reported unhealthy within its `max_silence`, however long the pass was healthy before.

A listing is a `Listing`: the items read, page by page by key, and the names of the items
that could not be read. A caller that acts on an item's absence (stops its workers, deletes
its route, unlinks it) treats those names as present: one unreadable row affects only itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

from shoal.catalog.client import CatalogClient
from shoal.catalog.errors import NotFoundError
from shoal.catalog.kinds import Kind
from shoal.catalog.resources import Meta, Workspace

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Meta)
T = TypeVar("T")

WRITES_AT_ONCE = 8
"""Catalog writes a pass keeps in flight: a cold pass's hundreds of creates overlap their
round trips, and the catalog is never asked for more than this at a time."""


YIELD_EVERY = 32
"""Items one worker of `each` takes between two yields to the event loop, whether or not
its work waited on anything (an entity found unchanged writes nothing): the workers take at
most 256 in one turn, within `routing.SLICE`."""


async def each(items: Iterable[T], work: Callable[[T], Awaitable[None]]) -> None:
    """`work(item)` for every item, `WRITES_AT_ONCE` at a time; `work` handles its own errors
    (one item's failure must not stop the others). `WRITES_AT_ONCE` workers take the items
    in turn: a task per item made 10,000 tasks in one turn of the event loop (~100 ms) before
    the first write."""
    pending = iter(items)

    async def worker() -> None:
        for count, item in enumerate(pending, 1):  # (one iterator: each item taken once)
            await work(item)
            if count % YIELD_EVERY == 0:
                await asyncio.sleep(0)

    # A failure (the leadership lost) stops the other workers before it is raised: with
    # `gather` they went on taking items after `each` had returned, beside the next pass.
    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(WRITES_AT_ONCE):
                group.create_task(worker())
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None


class Listing(list[M], Generic[M]):
    """The items of one listing, and `invalid`: those that could not be read (name → why)."""

    def __init__(self, items: Iterable[M] = (), invalid: dict[str, str] | None = None) -> None:
        super().__init__(items)
        self.invalid: dict[str, str] = invalid or {}


def _nothing() -> None:
    return None


class Calls:
    """The catalog calls of one controller, each followed by `beat()` once it completed, and
    each write (create, update, delete) preceded by `guard()`: the controller's leadership
    check (a clock read), which raises to stop the pass. Checked only before each phase, a
    replica that lapsed mid-phase (frozen past two TTLs) went on writing from its old
    listings while another led (a cold pass of 60 models: 111 writes after the lapse)."""

    def __init__(
        self,
        client: CatalogClient,
        beat: Callable[[], None] = _nothing,
        guard: Callable[[], None] = _nothing,
    ) -> None:
        self.client = client
        self.beat = beat
        self.guard = guard
        self._reported: set[tuple[str, str, str, str]] = set()  # unreadable rows logged

    @property
    def requests(self) -> int:
        """HTTP requests made so far (the client's count)."""
        return self.client.requests

    async def list_all(
        self, kind: Kind[M], workspace: str, filters: dict[str, str] | None = None
    ) -> Listing[M]:
        """Every item of `kind` in `workspace`, page by page by key (1000 a page), beating
        per page. A workspace that does not exist (yet) has no items."""
        found: Listing[M] = Listing()
        try:
            async for page in self.client.pages(kind, workspace=workspace, filters=filters):
                self.beat()
                found += page.items
                found.invalid.update(page.invalid)
        except NotFoundError as exc:
            if exc.param != "workspace":
                raise
            return Listing()
        for name, why in found.invalid.items():
            if (kind.plural, workspace, name, why) not in self._reported:  # once, not each pass
                self._reported.add((kind.plural, workspace, name, why))
                log.warning("%s %s/%s cannot be read (left as it is): %s",
                            kind.singular, workspace, name, why)  # fmt: skip
        return found

    async def get(self, kind: Kind[M], workspace: str, name: str) -> M:
        found = await self.client.get(kind, name, workspace=workspace)
        self.beat()
        return found

    async def create(self, kind: Kind[M], workspace: str, body: dict[str, Any]) -> M:
        self.guard()
        made = await self.client.create(kind, body, workspace=workspace)
        self.beat()
        return made

    async def update(
        self, kind: Kind[M], workspace: str, name: str, changes: dict[str, Any], version: int
    ) -> M:
        self.guard()
        done = await self.client.update(kind, name, changes, version=version, workspace=workspace)
        self.beat()
        return done

    async def delete(self, kind: Kind[Any], workspace: str, name: str, version: int) -> None:
        self.guard()
        await self.client.delete(kind, name, version=version, workspace=workspace)
        self.beat()

    async def workspaces(self) -> list[Workspace]:
        found = await self.client.workspaces()
        self.beat()
        return found
