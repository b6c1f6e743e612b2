"""The entity cache against a real catalog API (SQLite and PostgreSQL), calls counted."""

from __future__ import annotations

import pytest

from shoal.catalog import MODELS, CatalogClient
from shoal.catalog.cache import EntityCache, StagedChangesError
from shoal.catalog.calls import Calls

WS = "team-a"
P1, P2 = f"{WS}/p1", f"{WS}/p2"


async def fresh_cache(client: CatalogClient) -> EntityCache:
    cache = EntityCache(Calls(client), WS)
    await cache.refresh()
    return cache


async def test_refresh_is_one_paginated_list(client: CatalogClient) -> None:
    for i in range(3):
        await client.create(MODELS, {"name": f"m{i}"})
    before = client.requests
    cache = await fresh_cache(client)
    assert client.requests - before == 1
    assert cache.names() == ["m0", "m1", "m2"]


async def test_reads_see_staged_changes_over_the_snapshot(client: CatalogClient) -> None:
    await client.create(MODELS, {"name": "m", "description": "old"})
    cache = await fresh_cache(client)
    cache.stage_field_updates("m", {"description": "new"})
    cache.stage_provider_link("m", P1)
    cache.stage_create("n", {"autoprovisioned": True})
    before = client.requests
    m, n = await cache.get("m"), await cache.get("n")
    assert client.requests == before  # both known: no call
    assert m is not None and (m.description, m.providers) == ("new", [P1])
    assert n is not None and n.autoprovisioned
    assert (await client.get(MODELS, "m")).description == "old"  # nothing written yet


async def test_a_miss_costs_one_direct_get_then_reads_absent(client: CatalogClient) -> None:
    cache = await fresh_cache(client)
    await client.create(MODELS, {"name": "late"})  # made by someone else after the refresh
    before = client.requests
    late = await cache.get("late")
    assert late is not None and late.name == "late"
    assert await cache.get("never") is None
    assert await cache.get("never") is None and await cache.get("late") is not None
    assert client.requests - before == 2  # one get per unknown name, then remembered


async def test_refresh_is_refused_while_changes_are_staged(client: CatalogClient) -> None:
    await client.create(MODELS, {"name": "m"})
    cache = await fresh_cache(client)
    cache.stage_provider_link("m", P1)
    with pytest.raises(StagedChangesError, match="m"):
        await cache.refresh()
    await cache.flush()
    await cache.refresh()
    assert (await cache.get("m")).providers == [P1]  # type: ignore[union-attr]


async def test_link_and_unlink_cancel_each_other(client: CatalogClient) -> None:
    await client.create(MODELS, {"name": "linked", "providers": [P1]})
    await client.create(MODELS, {"name": "plain"})
    cache = await fresh_cache(client)
    cache.stage_provider_link("plain", P1)
    cache.stage_provider_unlink("plain", P1)
    cache.stage_provider_unlink("linked", P1)
    cache.stage_provider_link("linked", P1)
    assert cache.staged == []
    before = client.requests
    assert (await cache.flush()).written == []
    assert client.requests == before


async def test_an_entity_linked_by_two_providers_is_written_once(client: CatalogClient) -> None:
    await client.create(MODELS, {"name": "m"})
    cache = await fresh_cache(client)
    cache.stage_provider_link("m", P1)
    cache.stage_provider_link("m", P2)
    cache.stage_field_updates("m", {"description": "served twice"})
    before = client.requests
    result = await cache.flush()
    assert result.written == ["m"] and client.requests - before == 1
    entity = await client.get(MODELS, "m")
    assert (entity.providers, entity.description, entity.version) == ([P1, P2], "served twice", 2)


async def test_a_converged_flush_writes_nothing(client: CatalogClient) -> None:
    await client.create(MODELS, {"name": "m", "providers": [P1], "description": "d"})
    cache = await fresh_cache(client)
    cache.stage_create("m", {"autoprovisioned": True})
    cache.stage_provider_link("m", P1)
    cache.stage_field_updates("m", {"description": "d"})
    before = client.requests
    result = await cache.flush()
    assert (result.written, client.requests - before) == ([], 0)
    assert (await client.get(MODELS, "m")).version == 1


async def test_two_providers_creating_one_entity_collapse_to_one_create(
    client: CatalogClient,
) -> None:
    cache = await fresh_cache(client)
    for provider in (P1, P2):
        cache.stage_create("new", {"autoprovisioned": True})
        cache.stage_provider_link("new", provider)
    before = client.requests
    assert (await cache.flush()).written == ["new"]
    assert client.requests - before == 1
    made = await client.get(MODELS, "new")
    assert (made.providers, made.autoprovisioned, made.version) == ([P1, P2], True, 1)


async def test_a_create_conflict_adopts_the_existing_entity(client: CatalogClient) -> None:
    cache = await fresh_cache(client)
    cache.stage_create("m", {"autoprovisioned": True})
    cache.stage_provider_link("m", P1)
    await client.create(MODELS, {"name": "m", "description": "a user's", "providers": [P2]})
    result = await cache.flush()
    assert result.written == ["m"] and result.failed == {}
    entity = await client.get(MODELS, "m")
    assert (entity.description, entity.providers, entity.autoprovisioned) == (
        "a user's", [P2, P1], False,  # adopted: created as the user made it, then linked
    )  # fmt: skip


async def test_a_failed_write_stays_staged_and_does_not_stop_the_others(
    client: CatalogClient,
) -> None:
    for name in ("a", "b", "c"):
        await client.create(MODELS, {"name": name})
    cache = await fresh_cache(client)
    for name in ("a", "b", "c"):
        cache.stage_provider_link(name, P1)
    cache.stage_field_updates("b", {"context_length": 0})  # refused by the API (422)
    result = await cache.flush()
    assert result.written == ["a", "c"] and list(result.failed) == ["b"]
    assert "context_length" in result.failed["b"]
    assert cache.staged == ["b"]
    assert [(await client.get(MODELS, n)).providers for n in "abc"] == [[P1], [], [P1]]
    await cache.refresh()  # allowed: the flush attempted it; the change is carried over
    cache.stage_field_updates("b", {"context_length": 8192})
    result = await cache.flush()
    assert (result.written, cache.staged) == (["b"], [])
    b = await client.get(MODELS, "b")
    assert (b.providers, b.context_length) == ([P1], 8192)


async def test_a_stale_snapshot_merges_into_the_current_entity(client: CatalogClient) -> None:
    await client.create(MODELS, {"name": "m", "providers": [P1]})
    cache = await fresh_cache(client)
    await client.update(MODELS, "m", {"description": "changed meanwhile"})
    cache.stage_provider_link("m", P2)
    assert (await cache.flush()).written == ["m"]
    entity = await client.get(MODELS, "m")
    assert (entity.providers, entity.description) == ([P1, P2], "changed meanwhile")
