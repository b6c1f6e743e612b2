"""Alembic migrations build exactly the schema the code uses, and run idempotently."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from shoal.catalog.database import current_revision, migrate, open_engine
from shoal.catalog.tables import metadata
from tests.catalog.test_cli import catalog_cli
from tests.postgres_server import PostgresDatabase

HEAD = "0001"


async def test_migrations_create_exactly_the_tables_the_code_uses(database_url: str) -> None:
    engine = open_engine(database_url)
    try:
        await migrate(engine)
        await migrate(engine)  # a second run (every start) changes nothing and does not fail

        def differences(connection: sa.Connection) -> list[Any]:
            return list(compare_metadata(MigrationContext.configure(connection), metadata))

        async with engine.connect() as conn:
            assert await conn.run_sync(differences) == []
            assert await current_revision(conn) == HEAD
    finally:
        await engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_database_urls(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[str]]:
    """Three databases never migrated, of each backend (PostgreSQL: made for this test)."""
    if request.param == "sqlite":
        yield [f"sqlite:///{tmp_path / f'catalog-{i}.db'}" for i in range(3)]
        return
    databases = [PostgresDatabase() for _ in range(3)]
    try:
        yield [database.url for database in databases]
    finally:
        for database in databases:
            database.close()


async def test_concurrent_migrations_of_a_fresh_database_all_succeed(
    fresh_database_urls: list[str],
) -> None:
    """Six `serve` replicas or `migrate` commands starting at once on a database nobody has
    migrated: one upgrades, the others wait for it and find the schema at head."""
    for url in fresh_database_urls:  # the race is lost only now and then: several tries
        engines = [open_engine(url) for _ in range(6)]
        try:
            await asyncio.wait_for(asyncio.gather(*(migrate(e) for e in engines)), 30)
            async with engines[0].connect() as conn:
                assert await current_revision(conn) == HEAD
        finally:
            for engine in engines:
                await engine.dispose()


async def test_six_migrate_commands_at_once_on_fresh_postgresql_all_exit_0() -> None:
    fresh = PostgresDatabase()
    try:
        results = await asyncio.gather(
            *(catalog_cli("migrate", "--db", fresh.url) for _ in range(6))
        )
    finally:
        fresh.close()
    assert [code for code, _, _ in results] == [0] * 6, results
