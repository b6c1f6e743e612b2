"""Alembic migrations build exactly the schema the code uses, and run idempotently."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from shoal.catalog.database import current_revision, migrate, open_engine
from shoal.catalog.tables import metadata


async def test_migrations_create_exactly_the_tables_the_code_uses(database_url: str) -> None:
    engine = open_engine(database_url)
    try:
        await migrate(engine)
        await migrate(engine)  # a second run (every start) changes nothing and does not fail

        def differences(connection: sa.Connection) -> list[Any]:
            return list(compare_metadata(MigrationContext.configure(connection), metadata))

        async with engine.connect() as conn:
            assert await conn.run_sync(differences) == []
            assert await current_revision(conn) == "0001"
    finally:
        await engine.dispose()
