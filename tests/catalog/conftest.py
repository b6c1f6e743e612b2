"""Catalog fixtures: every test runs on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from shoal.catalog import CatalogClient, CatalogConfig, CatalogServer
from shoal.catalog.database import migrate, open_engine
from shoal.catalog.tables import metadata
from tests.postgres_server import PostgresDatabase


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresDatabase]:
    """This session's own database on a real PostgreSQL server, dropped at the end."""
    database = PostgresDatabase()
    yield database
    database.close()


@pytest.fixture(params=["sqlite", "postgresql"])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """An empty, migrated catalog database of each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'catalog.db'}"
        return
    url = request.getfixturevalue("postgres").url
    engine = open_engine(url)
    try:
        await migrate(engine)
        async with engine.begin() as conn:
            names = ", ".join(t.name for t in metadata.sorted_tables)
            await conn.execute(sa.text(f"TRUNCATE {names} RESTART IDENTITY"))
    finally:
        await engine.dispose()
    yield url


@pytest.fixture
async def catalog(database_url: str) -> AsyncIterator[CatalogServer]:
    """A catalog API on a free port, no admin token."""
    server = CatalogServer(CatalogConfig(database_url=database_url, port=0))
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def client(catalog: CatalogServer) -> AsyncIterator[CatalogClient]:
    async with CatalogClient(catalog.url, workspace="team-a") as client:
        yield client
