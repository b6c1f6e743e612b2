"""`/v1/models` and `/v1/models/{name}`: what a caller sees, one listing per view, made in slices.

A view is what a request sees of the virtual models (`RouteTable.visible`): a key's, its own
workspace's alone; a request without a team's key (None), every served workspace's, the first
`--workspace` winning a name. A view's listing holds the discovered models (but those a virtual
model of the view hides) and the view's virtual models with a serving target, by name; a key's
allow-list is then looked up in it (`keys.models_for`), never decoded.

A view's listing is made again only after the registry or the view's routes changed (its
`version`), by the next caller, `LISTING_SLICE` models a turn of the event loop (10,000 virtual
models made at once held it 14-111 ms), once for every caller waiting meanwhile. One is made
at a time per view: a caller that comes while an older one is made waits for the next, started
once that one ends (a change every millisecond had each caller make its own, at once); and one
view's at a time (three workspaces' made at once made three slices a turn). The discovered
models' objects are made once per registry version for every view, which share them. A listing
is made from one copy of the view's routes (its objects and the fleet models they hide), taken
in one turn, and its body joined in one copy. Memory: a listing per view at most (the served
workspaces, plus one).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import operator
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec

from shoal.discovery.grants import Grant
from shoal.frontend.http import errors
from shoal.frontend.keys.keys import KeyRing, ModelListing, models_for
from shoal.frontend.registry.registry import Model, Registry
from shoal.frontend.virtual.targets import FleetChoice
from shoal.frontend.virtual.virtual import RouteTable, VirtualModel

LISTING_SLICE = 1000  # models a `/v1/models` listing makes between two turns of the loop
View = str | None  # a key's workspace; None: a request without a team's key
Version = tuple[int, int]  # (the registry's version, the view's routes' version)
_json = msgspec.json.encode
_ID = operator.itemgetter("id")


class Listings:
    """The `/v1/models` listings of every view (see the module's docstring)."""

    def __init__(
        self, registry: Registry, routes: RouteTable, loaded: Callable[[], bool] = lambda: True
    ) -> None:
        self.registry = registry
        self.routes = routes
        self.loaded = loaded  # the registry holds the fleet (before: 503, retry, not 404)
        self._made: dict[View, tuple[Version, ModelListing]] = {}
        self._making: dict[View, tuple[Version, asyncio.Future[ModelListing]]] = {}
        self._next: dict[View, asyncio.Future[ModelListing]] = {}  # made once that one ends
        self._fleet: tuple[int, asyncio.Future[list[dict[str, Any]]]] | None = None
        self._one_at_a_time = asyncio.Lock()  # (of every view: a slice per turn of the loop)

    def version(self, view: View) -> Version:
        return self.registry.version, self.routes.version_of(view)

    def listing(self, grant: Grant | None) -> bytes | Awaitable[bytes]:
        """The `/v1/models` body for a caller with `grant` (None: no team's key): at once when
        its view's listing is as new as the registry and its routes, else once it is made."""
        view = None if grant is None else grant.workspace
        version = self.version(view)
        made = self._made.get(view)
        if made is not None and made[0] == version:
            return models_for(made[1], grant)
        return self._later(view, version, grant)

    def model(self, name: str, grant: Grant | None) -> bytes:
        """The `/v1/models/{name}` body for a caller with `grant`; `ApiError` 404 for a model
        it may not use or does not see, as for one that does not exist (503 while loading, as
        a request to it answers)."""
        if not KeyRing.allows(grant, name):  # as if absent: nothing told about it
            raise errors.model_not_found(name)
        virtual = self.routes.lookup(name, None if grant is None else grant.workspace)
        if virtual is not None:  # wins over a discovered model of the same name
            if not virtual.serving:  # (while loading, its targets may be live)
                raise (
                    errors.model_not_found(name)
                    if self.loaded()
                    else errors.discovery_loading(name)
                )
            return _json(self.virtual_object(virtual))
        model = self.registry.models.get(name)
        if model is None or not model.listed:  # (while loading: as a request to it is)
            raise errors.model_not_found(name) if self.loaded() else errors.discovery_loading(name)
        if not model.serving:
            raise errors.no_ready_instance(name)  # draining: the same 503 as requests
        return _json(self.model_object(model))

    async def _later(self, view: View, version: Version, grant: Grant | None) -> bytes:
        """The body for `grant`, once a listing of `view` as new as `version` is made (one
        for every caller meanwhile: a caller that leaves does not stop it)."""
        making, after = self._making.get(view), self._next.get(view)
        if making is not None and not _failed(making[1]) and _covers(making[0], version):
            future = making[1]  # (one that failed is made anew, not awaited again)
        elif (making is not None and not making[1].done()) or after is not None:
            if after is None:
                after = self._next[view] = asyncio.ensure_future(self._after(view, making))
            future = after
        else:
            future = self._start(view)
        return models_for(await asyncio.shield(future), grant)

    def _start(self, view: View) -> asyncio.Future[ModelListing]:
        version = self.version(view)
        future = asyncio.ensure_future(self._make(view, version))
        self._making[view] = (version, future)
        return future

    async def _after(
        self, view: View, making: tuple[Version, asyncio.Future[ModelListing]] | None
    ) -> ModelListing:
        """The listing of `view` started once `making` ends, at the versions then."""
        try:
            if making is not None:
                await asyncio.wait([making[1]])
        finally:
            del self._next[view]
        return await self._start(view)

    async def _make(self, view: View, version: Version) -> ModelListing:
        """`view`'s listing: the discovered models' objects (shared by every view) but those a
        virtual model of the view hides, and its virtual models with a serving target, by id;
        sorted a slice at a time, then merged and encoded a slice at a time."""
        async with self._one_at_a_time:
            return await self._make_now(view, version)

    async def _make_now(self, view: View, version: Version) -> ModelListing:
        fleet = await self._fleet_objects(version[0])
        # One state of the view's routes for both the objects and the fleet models they hide:
        # the live routes, read a slice a turn, let a route put or deleted meanwhile list its
        # name twice (the fleet's object and its own) or not at all.
        virtuals = list(self.routes.visible(view).values())
        hidden: set[str] = set()
        chunks: list[list[dict[str, Any]]] = [[]]  # (each sorted by id: merged below)
        for count, virtual in enumerate(virtuals, 1):
            hidden.add(virtual.name)
            if virtual.serving:
                chunks[-1].append(self.virtual_object(virtual))
            if count % LISTING_SLICE == 0:
                chunks[-1].sort(key=_ID)
                chunks.append([])
                await asyncio.sleep(0)
        chunks[-1].sort(key=_ID)
        del virtuals
        routes, kept = self.routes, []
        for count, obj in enumerate(fleet, 1):
            if obj["id"] not in hidden:
                kept.append(obj)
            elif view is None:
                routes.shadows(obj["id"])  # (a clash is logged once)
            if count % LISTING_SLICE == 0:
                await asyncio.sleep(0)
        del hidden
        chunks.append(kept)
        pieces: list[bytes] = [b'{"object":"list","data":[']
        # A key's allow-list is looked up in its view's objects; a request without a team's
        # key is given the body alone: that view keeps none (10 workspaces of 10,000 virtual
        # models: ~30 MB kept, freed in one turn of 8-20 ms when it was made again).
        by_id: dict[str, dict[str, Any]] = {}
        async for batch in _merged(chunks):
            if len(pieces) > 1:
                pieces.append(b",")
            pieces.append(_json(batch)[1:-1])  # (the objects, without the list's brackets)
            if view is not None:
                by_id.update((obj["id"], obj) for obj in batch)
        pieces.append(b"]}")
        body = b"".join(pieces)  # (one copy: head and tail added after a join copied it twice)
        del pieces
        listing = ModelListing.made(body, by_id)
        self._made[view] = (version, listing)
        return listing

    async def _fleet_objects(self, version: int) -> list[dict[str, Any]]:
        """The listed discovered models' objects by id, made once per registry `version` for
        every view (one made for an older version is made again; one that failed, anew)."""
        held = self._fleet
        if held is None or held[0] < version or _failed(held[1]):
            held = self._fleet = (version, asyncio.ensure_future(self._make_fleet()))
        return await asyncio.shield(held[1])

    async def _make_fleet(self) -> list[dict[str, Any]]:
        chunks: list[list[dict[str, Any]]] = [[]]
        for count, model in enumerate(list(self.registry.models.values()), 1):
            if model.listed:
                chunks[-1].append(self.model_object(model))
            if count % LISTING_SLICE == 0:
                chunks[-1].sort(key=_ID)
                chunks.append([])
                await asyncio.sleep(0)
        chunks[-1].sort(key=_ID)
        data: list[dict[str, Any]] = []
        async for batch in _merged(chunks):
            data += batch
        return data

    def model_object(self, model: Model) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": model.name,
            "object": "model",
            "created": model.created,
            "owned_by": "shoal",
        }
        parent = None if model.parent is None else self.registry.models.get(model.parent)
        if parent is not None and parent.listed:  # never name a model that is not listed
            obj["parent"] = parent.name
        return obj

    def virtual_object(self, virtual: VirtualModel) -> dict[str, Any]:
        """A virtual model as `/v1/models` shows it; `created` is its first fleet target's."""
        created = 0
        for choice in virtual.choices:
            fleet = isinstance(choice, FleetChoice)
            model = self.registry.models.get(choice.served) if fleet else None
            if model is not None:
                created = model.created
                break
        return {"id": virtual.name, "object": "model", "created": created, "owned_by": "shoal"}


async def _merged(chunks: list[list[dict[str, Any]]]) -> AsyncIterator[list[dict[str, Any]]]:
    """The objects of `chunks` (each sorted by id) in one order by id, `LISTING_SLICE` a turn
    of the loop: a sort and an encoding of 30,000 objects in one go held it 30-40 ms."""
    merged = heapq.merge(*map(_drained, chunks), key=_ID)
    while batch := list(itertools.islice(merged, LISTING_SLICE)):
        yield batch
        await asyncio.sleep(0)


def _drained(chunk: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """`chunk`'s items in order, each let go of as it is taken: the objects a listing does not
    keep are freed a slice a turn, not all at once at its end."""
    chunk.reverse()
    while chunk:
        yield chunk.pop()


def _failed(future: asyncio.Future[Any]) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)


def _covers(made: Version, asked: Version) -> bool:
    """Whether a listing made from versions `made` is as new as a caller of `asked` needs."""
    return made[0] >= asked[0] and made[1] >= asked[1]
