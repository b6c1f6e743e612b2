"""Lists and gets are one SQL statement each, whatever the page size (no N+1)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from shoal.catalog import DEPLOYMENTS, MODELS, VIRTUAL_MODELS, CatalogClient, CatalogServer


@contextmanager
def counting(server: CatalogServer) -> Iterator[list[str]]:
    """The SQL statements the server runs inside the block."""
    assert server.engine is not None
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    sa.event.listen(server.engine.sync_engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        sa.event.remove(server.engine.sync_engine, "before_cursor_execute", record)


async def test_list_and_get_are_one_statement_each(
    catalog: CatalogServer, client: CatalogClient
) -> None:
    for i in range(30):
        await client.create(MODELS, {"name": f"m{i}", "providers": ["team-a/p1", "team-a/p2"]})
        await client.create(VIRTUAL_MODELS, {"name": f"v{i}", "default_model": f"m{i}"})
    await client.create(DEPLOYMENTS, {"name": "d", "model": "m", "engine": "mocker"})
    await client.get(MODELS, "m0")  # warm the pool: connection set-up is not a request's cost
    for kind, name in ((MODELS, "m7"), (VIRTUAL_MODELS, "v7"), (DEPLOYMENTS, "d")):
        with counting(catalog) as statements:
            await client.get(kind, name)
        assert len(statements) == 1, statements
        with counting(catalog) as statements:
            page = await client.list(kind, page_size=1000)
        assert len(statements) == 1, statements
        assert page.total == len(page.items) > 0
    with counting(catalog) as statements:
        page = await client.list(MODELS, page=2, page_size=10, filters={"format": ""})
    assert len(statements) == 1 and len(page.items) == 10
    before = client.requests
    assert len(await client.list_all(MODELS, page_size=7)) == 30
    assert client.requests - before == 5  # one request per page, ceil(30 / 7)
