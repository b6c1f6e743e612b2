"""A view's `/v1/models` listing is made from one state of its routes, and its body assembled
in one copy: a real `RouteTable` and `Listings`, the registry a plain table of listed models
(the listing reads its `version` and `models` alone)."""

from __future__ import annotations

import asyncio
import collections
import tracemalloc
from types import SimpleNamespace

import msgspec

from shoal.discovery import FleetTarget, Route
from shoal.discovery.grants import Grant
from shoal.frontend import listings
from shoal.frontend.listings import Listings
from shoal.frontend.virtual.virtual import RouteTable

FLEET = 3 * listings.LISTING_SLICE  # (the fleet's filter then yields three times)


class Fleet:
    """What `Listings` reads of a registry: its version and its listed, serving models."""

    def __init__(self, count: int) -> None:
        self.version = 1
        self.models = {
            name: SimpleNamespace(name=name, listed=True, serving=True, created=1, parent=None)
            for name in (f"fleet{i:05d}" for i in range(count))
        }


def routed(table: RouteTable, workspace: str, name: str) -> Route:
    route = Route(workspace=workspace, name=name, targets=(FleetTarget("fleet00000"),))
    table.put(route.key, route.to_json())
    return route


async def test_a_listing_made_while_a_route_named_like_a_fleet_model_changes_lists_it_once() -> (
    None
):
    """The fleet's objects were filtered against the live routes, a slice a turn, and the
    virtual models taken after: a passthrough route (named like a fleet model) put or deleted
    meanwhile made the listing name that model twice (the fleet's object and the route's) or
    not at all. Now both come from one snapshot of the view's routes."""
    fleet = Fleet(FLEET)
    table = RouteTable(fleet, ("w0",))  # type: ignore[arg-type]
    for i in range(100):
        routed(table, "w0", f"vm{i:03d}")
    churned = routed(table, "w0", "fleet00100")
    made = Listings(fleet, table)  # type: ignore[arg-type]
    stop = asyncio.Event()

    async def churn() -> None:  # put, delete, put, ... one change a turn of the loop
        while not stop.is_set():
            if "fleet00100" in table.routes["w0"]:
                table.delete(churned.key)
            else:
                table.put(churned.key, churned.to_json())
            await asyncio.sleep(0)

    task = asyncio.create_task(churn())
    counts = []
    try:
        for _ in range(6):
            body = made.listing(None)
            body = body if isinstance(body, bytes) else await body
            ids = [obj["id"] for obj in msgspec.json.decode(body)["data"]]
            counts.append(collections.Counter(ids)["fleet00100"])
            assert len(ids) - len(set(ids)) == counts[-1] - 1 or counts[-1] == 0, ids
    finally:
        stop.set()
        await task
        table.close()
    assert counts == [1] * 6, counts


async def test_a_views_listing_body_is_assembled_in_one_copy() -> None:
    """The body of a view's listing was joined from its pieces, then copied twice more to add
    the list's head and tail: at 10 workspaces of 10,000 virtual models (a 6.8 MB body) the
    copies held the loop 27-48 ms on this machine (one join: 0.7-8 ms), and a key's view of
    12,000 objects held 2.1 bodies' worth beyond the listing kept. Now it is one join: the
    pieces alone (1.1 bodies' worth)."""
    fleet = Fleet(10)
    table = RouteTable(fleet, ("w0",))  # type: ignore[arg-type]
    for i in range(12 * listings.LISTING_SLICE):
        routed(table, "w0", f"vm{i:05d}")
    made = Listings(fleet, table)  # type: ignore[arg-type]
    key = Grant(workspace="w0", name="k", hash="0" * 64)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        body = made.listing(key)
        body = body if isinstance(body, bytes) else await body
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        table.close()
    assert len(msgspec.json.decode(body)["data"]) == 12 * listings.LISTING_SLICE + 10
    transient = peak - kept
    assert transient < 1.5 * len(body), (transient, len(body), kept - before)


async def test_the_listing_of_requests_without_a_team_key_keeps_its_body_alone() -> None:
    """Every view's listing kept each model's object by id, for a key's allow-list; a request
    without a team's key is given the whole body, so that view's objects were never read: at
    10 workspaces of 10,000 virtual models ~30 MB kept, and freed in one turn (8-20 ms) each
    time it was made again. That view now keeps its body alone; a key's view its objects."""
    fleet = Fleet(10)
    workspaces = ("w0", "w1", "w2")
    table = RouteTable(fleet, workspaces)  # type: ignore[arg-type]
    for ws in workspaces:
        for i in range(4 * listings.LISTING_SLICE):
            routed(table, ws, f"vm{i:05d}-{ws}")
    made = Listings(fleet, table)  # type: ignore[arg-type]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        body = made.listing(None)
        body = body if isinstance(body, bytes) else await body
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    key = Grant(workspace="w1", name="k", hash="0" * 64, models=("vm00007-w1", "vm00007-w0"))
    mine = made.listing(key)
    mine = mine if isinstance(mine, bytes) else await mine
    table.close()
    assert kept < 1.5 * len(body), (kept, len(body))
    assert [obj["id"] for obj in msgspec.json.decode(mine)["data"]] == ["vm00007-w1"]
