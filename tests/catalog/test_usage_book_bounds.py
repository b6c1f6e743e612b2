"""A frontend's `UsageBook` against a real catalog (SQLite): what a client can put in a row
(a model name of any length, any characters) or how many rows it makes never holds the usage
of every key back behind one batch the catalog refuses."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shoal.catalog import CatalogClient, CatalogConfig, CatalogServer
from shoal.discovery.grants import Grant
from shoal.frontend.keys.usage import UsageBook

GRANT = Grant(workspace="team-a", name="team", hash="a" * 64)


@pytest.fixture
async def catalog(tmp_path: Path) -> AsyncIterator[CatalogServer]:
    server = CatalogServer(CatalogConfig(f"sqlite:///{tmp_path / 'catalog.db'}", port=0))
    await server.start()
    yield server
    await server.stop()


async def requests_counted(catalog: CatalogServer) -> int:
    async with CatalogClient(catalog.url, workspace="team-a") as client:
        return sum(item["requests"] for item in await client.usage(group_by="key"))


async def test_rows_over_the_catalogs_body_bound_are_all_counted(catalog: CatalogServer) -> None:
    book = UsageBook(catalog.url, interval=3600)
    await book.start()
    try:
        for i in range(6000):  # a busy fleet: many keys x models in one interval (> 1 MiB)
            book.record(GRANT, f"model-{i:05d}-" + "m" * 100, "served", 200, 1, 1)
        await book.flush()
        assert book.describe()["last_error"] is None
        assert not book.pending
    finally:
        await book.stop()
    assert await requests_counted(catalog) == 6000


async def test_a_model_name_the_catalog_would_refuse_holds_back_no_usage(
    catalog: CatalogServer,
) -> None:
    book = UsageBook(catalog.url, interval=3600)
    await book.start()
    try:
        book.record(GRANT, "x" * 5000, "", 404, 0, 0)  # a client's own model name: 404
        book.record(GRANT, "nul\x00name", "", 404, 0, 0)
        book.record(GRANT, "chat", "chat", 200, 10**20, 0)  # a worker's claim of usage
        await book.flush()
        assert not book.pending, book.describe()
    finally:
        await book.stop()
    assert await requests_counted(catalog) == 3


async def test_a_batch_the_catalog_refuses_is_dropped_and_the_next_ones_counted(
    catalog: CatalogServer,
) -> None:
    book = UsageBook(catalog.url, interval=3600)
    await book.start()
    try:
        stray = Grant(workspace="Not A Workspace", name="team", hash="b" * 64)
        book.record(stray, "chat", "chat", 200, 1, 1)
        await book.flush()
        book.record(GRANT, "chat", "chat", 200, 1, 1)
        await book.flush()
        described = book.describe()
        assert not book.pending, described
        assert described["dropped_rows"] == 1
        assert "422" in described["last_refused"]
    finally:
        await book.stop()
    assert await requests_counted(catalog) == 1


async def test_distinct_rows_between_two_flushes_are_bounded() -> None:
    book = UsageBook("http://127.0.0.1:9", max_rows=100, interval=3600)
    for i in range(1000):
        book.record(GRANT, f"model-{i}", "", 404, 0, 0)
    book.record(GRANT, "model-0", "", 404, 0, 0)  # a row held still adds up
    assert len(book.rows) == 100
    assert book.describe()["dropped_rows"] == 900
