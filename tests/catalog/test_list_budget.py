"""A list page is bounded in bytes, not only in items: it ends early at
`repository.PAGE_BYTES` of encoded items (at least one item), the listing goes on by
`next_after`, and serving it never holds the catalog's event loop (its rows are encoded
`repository.FETCH_ROWS` at most a turn, their data never decoded: counted, not timed); on
SQLite and PostgreSQL."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import aiohttp
import msgspec
import pytest

from shoal.catalog import MODELS, CatalogClient, CatalogServer, repository
from shoal.catalog.errors import InvalidError
from tests.helpers import LoopTurns

MODEL_COUNT = 100
TEXT_SPEC = {"text": "x" * 60_000}  # ~60 KiB: within the API's 64 KiB bound
# ~60 KiB of tiny arrays: what costs the most to decode and encode per byte
TINY_SPEC = {"x": [[i % 10] for i in range(12_000)]}


async def make_models(catalog: CatalogServer, client: CatalogClient, spec: Any) -> None:
    """`MODEL_COUNT` models holding `spec`: the first through the API (which makes the
    workspace and checks that `spec` is within its bounds), the others as the API would
    store them, in one statement (validating 100 specs of 12,000 values takes seconds)."""
    assert 55_000 < len(json.dumps(spec)) < 62_000  # as the API counts it
    first = await client.create(MODELS, {"name": "m000", "spec": spec})
    row = {k: v for k, v in first.model_dump(mode="json").items() if k in META}
    data = {k: v for k, v in first.model_dump(mode="json").items() if k not in META}
    now = datetime.now(UTC)
    rows = [
        {**row, "name": f"m{i:03}", "data": data, "created_at": now, "updated_at": now}
        for i in range(1, MODEL_COUNT)
    ]
    assert catalog.engine is not None
    async with catalog.engine.begin() as conn:
        await conn.execute(MODELS.table.insert(), rows)


META = ("name", "workspace", "version", "created_at", "updated_at")


async def get_page(client: CatalogClient, **params: str) -> tuple[int, dict[str, Any]]:
    """(bytes, decoded) of one raw list page of models."""
    url = f"{client.base_url}/v1/workspaces/{client.workspace}/models"
    async with aiohttp.ClientSession() as session, session.get(url, params=params) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.read()
    return len(body), msgspec.json.decode(body)


async def test_pages_of_large_items_stay_under_the_byte_budget_and_list_every_item(
    catalog: CatalogServer, client: CatalogClient
) -> None:
    await make_models(catalog, client, TEXT_SPEC)
    names: list[str] = []
    sizes: list[int] = []
    params = {"page_size": "1000"}
    while True:
        size, page = await get_page(client, **params)
        sizes.append(size)
        names += [item["name"] for item in page["items"]]
        assert page["items"] and page["total"] == MODEL_COUNT
        if page["next_after"] is None:
            break
        assert page["next_page"] is None  # a page cut early is continued only by name
        params = {"page_size": "1000", "after": page["next_after"]}
    assert len(sizes) >= 2 and max(sizes) <= repository.PAGE_BYTES + 1024, sizes
    assert names == [f"m{i:03}" for i in range(MODEL_COUNT)]
    # the client (so the controller and `shoal catalog get`) follows the early ends
    before = client.requests
    listed = await client.list_all(MODELS)
    assert [m.name for m in listed] == names and listed[0].spec == TEXT_SPEC
    assert client.requests - before == len(sizes)


async def test_serving_a_page_of_large_items_does_not_hold_the_event_loop(
    catalog: CatalogServer, client: CatalogClient
) -> None:
    await make_models(catalog, client, TINY_SPEC)
    await get_page(client, page_size="10")  # warm the connection pool
    listed = LoopTurns().wrap(repository, "_listed")  # the catalog serves on this very loop
    decoded = LoopTurns().wrap(repository, "_document")
    try:
        _, page = await get_page(client, page_size="1000")
    finally:
        await listed.stop()
        await decoded.stop()
    assert 1 < len(page["items"]) < MODEL_COUNT  # (a page cut at its bytes)
    assert len(page["items"]) <= listed.on_loop <= len(page["items"]) + repository.FETCH_ROWS
    most = listed.most_per_turn
    assert most <= repository.FETCH_ROWS, f"{most} rows encoded in one turn of the loop"
    assert decoded.on_loop == decoded.off_loop == 0


async def test_an_item_over_the_budget_is_a_page_of_its_own(
    client: CatalogClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b", "c", "d"):
        await client.create(MODELS, {"name": name, "spec": {"x": 1}})
    monkeypatch.setattr(repository, "PAGE_BYTES", 10)  # every item is over it
    _, first = await get_page(client, page_size="1000")
    assert [i["name"] for i in first["items"]] == ["a"] and first["next_after"] == "a"
    assert [m.name for m in await client.list_all(MODELS)] == ["a", "b", "c", "d"]
    # a page the budget would cut that cannot go on by name is refused, not shortened
    with pytest.raises(InvalidError) as caught:
        await client.list(MODELS, page=2, page_size=2)
    assert caught.value.param == "page_size"
    with pytest.raises(InvalidError) as caught:
        await client.list(MODELS, sort="version")
    assert caught.value.param == "page_size"
    monkeypatch.setattr(repository, "PAGE_BYTES", 1 << 20)
    page = await client.list(MODELS, page=2, page_size=1)
    assert [m.name for m in page.items] == ["b"] and page.next_page == 3
