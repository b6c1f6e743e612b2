"""Alembic migrations build exactly the schema the code uses, and run idempotently."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from shoal.catalog import MODELS, PROVIDERS, tables
from shoal.catalog.database import MIGRATIONS, current_revision, migrate, open_engine
from shoal.catalog.repository import Repository
from shoal.catalog.resources import ModelSpec, ProviderSpec
from shoal.catalog.tables import metadata
from tests.catalog.test_cli import catalog_cli
from tests.postgres_server import PostgresDatabase

# The newest revision in the migrations directory (what `migrate` must reach).
HEAD = ScriptDirectory(MIGRATIONS).get_current_head()
assert HEAD is not None and HEAD >= "0002"


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
def fresh_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """Makes databases never migrated, of each backend (PostgreSQL: made for this test)."""
    made: list[PostgresDatabase] = []

    def make() -> str:
        if request.param == "sqlite":
            return f"sqlite:///{tmp_path / f'catalog-{len(list(tmp_path.iterdir()))}.db'}"
        made.append(PostgresDatabase())
        return made[-1].url

    yield make
    for database in made:
        database.close()


async def test_concurrent_migrations_of_a_fresh_database_all_succeed(
    fresh_database: Callable[[], str],
) -> None:
    """Six `serve` replicas or `migrate` commands starting at once on a database nobody has
    migrated: one upgrades, the others wait for it and find the schema at head."""
    for _ in range(3):  # the race is lost only now and then: several tries
        url = fresh_database()
        engines = [open_engine(url) for _ in range(6)]
        try:
            await asyncio.wait_for(asyncio.gather(*(migrate(e) for e in engines)), 30)
            async with engines[0].connect() as conn:
                assert await current_revision(conn) == HEAD
        finally:
            for engine in engines:
                await engine.dispose()


async def test_migration_renames_dot_segment_names_and_strips_url_credentials(
    fresh_database: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    engine = open_engine(fresh_database())
    now = datetime.now(UTC)

    def row(table: sa.Table, name: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"workspace": "w", "name": name, "version": 1, "created_at": now,
                "updated_at": now, "data": data}  # fmt: skip

    model = ModelSpec().model_dump(mode="json")
    try:
        await migrate(engine, "0001")
        async with engine.begin() as conn:
            await conn.execute(
                tables.workspaces.insert().values(name="w", version=1, created_at=now)
            )
            names = ["x/../y", "y", "x/dotdot/y", "a/./b", "a/b/..", "a/..b/c.", "k/" * 98 + ".."]
            await conn.execute(
                tables.models.insert(), [row(tables.models, n, model) for n in names]
            )
            url = {"type": "url", "base_url": "http://admin:pw@host:8080/v1?x=@"}
            provider = ProviderSpec.model_construct(**url).model_dump(mode="json")
            await conn.execute(
                tables.providers.insert().values(**row(tables.providers, "p", provider))
            )
        with caplog.at_level(logging.WARNING, "shoal.catalog.migrations"):
            await migrate(engine)
        repo = Repository(engine)
        found = {
            m["name"]: m["version"]
            for m in map(msgspec.json.decode, (await repo.list(MODELS, "w")).items)
        }
        long = next(n for n in found if n.startswith("renamed-"))
        assert found == {
            "x/dotdot/y-2": 2, "y": 1, "x/dotdot/y": 1, "a/dot/b": 2, "a/b/dotdot": 2,
            "a/..b/c.": 1, long: 2,
        }  # fmt: skip
        cleaned = await repo.get(PROVIDERS, "w", "p")
        assert (cleaned.base_url, cleaned.version) == ("http://host:8080/v1?x=@", 2)
        assert "models w/x/../y renamed to 'x/dotdot/y-2'" in caplog.text
        assert "provider w/p: credentials removed" in caplog.text and "pw" not in caplog.text
        await migrate(engine)  # nothing left to change
        assert (await repo.get(MODELS, "w", "a/dot/b")).version == 2
    finally:
        await engine.dispose()


async def test_six_migrate_commands_at_once_on_a_fresh_postgresql_all_exit_0() -> None:
    """As processes, on PostgreSQL where the race was seen (SQLite: the test above)."""
    fresh = PostgresDatabase()
    try:
        results = await asyncio.gather(
            *(catalog_cli("migrate", "--db", fresh.url) for _ in range(6))
        )
    finally:
        fresh.close()
    assert [code for code, _, _ in results] == [0] * 6, results


async def test_migration_strips_credentials_from_base_urls_urlsplit_cannot_parse(
    fresh_database: Callable[[], str],
) -> None:
    """0001 accepted any `https?://\\S+`: a row `urlsplit` refuses (an unclosed IPv6 bracket)
    must not stop the migration, so every replica can start, and loses its credentials too."""
    engine = open_engine(fresh_database())
    now = datetime.now(UTC)
    urls = {"creds": "http://admin:pw@[::1/v1", "bad": "http://[bad/v1", "ok": "http://h/v1"}
    try:
        await migrate(engine, "0001")
        async with engine.begin() as conn:
            await conn.execute(
                tables.workspaces.insert().values(name="w", version=1, created_at=now)
            )
            for name, url in urls.items():
                data = ProviderSpec.model_construct(type="url", base_url=url)
                await conn.execute(
                    tables.providers.insert().values(
                        workspace="w", name=name, version=1, created_at=now, updated_at=now,
                        data=data.model_dump(mode="json"),
                    )
                )  # fmt: skip
        await migrate(engine)
        repo = Repository(engine)
        found = {p["name"]: p["data"]["base_url"] if "data" in p else p["base_url"]
                 for p in map(msgspec.json.decode, (await repo.list(PROVIDERS, "w")).items)}  # fmt: skip
        assert found == {"creds": "http://[::1/v1", "bad": "http://[bad/v1", "ok": "http://h/v1"}
    finally:
        await engine.dispose()
