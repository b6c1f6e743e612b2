"""Opening the catalog database by URL, and bringing its schema up to date with Alembic.

`sqlite:///path` (the embedded default, a file in the state directory) or
`postgresql://host/db` for clusters; the async drivers (aiosqlite, asyncpg) are filled in.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

MIGRATIONS = str(Path(__file__).parent / "migrations")


def default_database_url() -> str:
    """`SHOAL_CATALOG_DB`, else `catalog.db` beside the default store in the state directory."""
    if url := os.environ.get("SHOAL_CATALOG_DB"):
        return url
    import platformdirs

    return f"sqlite:///{Path(platformdirs.user_state_dir('shoal')) / 'catalog.db'}"


def async_url(url: str) -> sa.URL:
    """`url` with its async driver: aiosqlite for SQLite, asyncpg for PostgreSQL."""
    parsed = sa.make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return parsed.set(drivername="sqlite+aiosqlite")
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+asyncpg")
    raise ValueError(f"catalog database {url!r}: use sqlite:///path or postgresql://host/db")


def open_engine(url: str) -> AsyncEngine:
    """An engine for `url`; a SQLite file gets its directory, WAL and a busy timeout."""
    target = async_url(url)
    args: dict[str, Any] = {}
    if target.get_backend_name() == "sqlite":
        if target.database and target.database != ":memory:":
            Path(target.database).parent.mkdir(parents=True, exist_ok=True)
        args["connect_args"] = {"timeout": 30}
    else:
        args["pool_size"] = 10
    engine = create_async_engine(target, **args)
    if target.get_backend_name() == "sqlite":
        sa.event.listen(engine.sync_engine, "connect", _sqlite_connect)
        sa.event.listen(engine.sync_engine, "begin", _sqlite_begin)
    return engine


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # transactions begin in `_sqlite_begin`, not the driver
    cursor = dbapi_connection.cursor()
    # Turning a fresh file to WAL wants it alone, and SQLite answers "locked" at once (no busy
    # wait) while another connection does the same: replicas starting together retry, in the
    # driver's thread, for as long as the busy timeout.
    deadline = time.monotonic() + 30
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(conn: sa.Connection) -> None:
    """Writes take the database lock when they begin (waiting up to the busy timeout), so a
    transaction that read a row never fails later on upgrading to a write. Reads begin
    nothing: each is one SELECT, atomic on its own, and stays one statement."""
    if conn.get_execution_options().get("shoal_write", False):
        conn.exec_driver_sql("BEGIN IMMEDIATE")


MIGRATION_LOCK = int.from_bytes(b"shoal-mg")
"""The PostgreSQL advisory lock key migrations hold (any 64-bit number no one else uses)."""


async def migrate(engine: AsyncEngine, revision: str = "head") -> None:
    """Apply every Alembic migration not yet applied up to `revision` (idempotent), in one
    write transaction.

    Migrations of one database are one at a time, so replicas and `catalog migrate` commands
    may start together: the transaction first takes the database's migration lock (PostgreSQL:
    an advisory lock until commit; SQLite: BEGIN IMMEDIATE, the database's write lock), and
    whoever waited finds the schema at head and does nothing."""
    async with engine.connect() as conn:
        await conn.execution_options(shoal_write=True)
        async with conn.begin():
            if conn.dialect.name == "postgresql":
                lock = sa.text("SELECT pg_advisory_xact_lock(:key)")
                await conn.execute(lock, {"key": MIGRATION_LOCK})
            await conn.run_sync(_upgrade, revision)


def _upgrade(connection: sa.Connection, revision: str) -> None:
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", MIGRATIONS)
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


async def current_revision(conn: AsyncConnection) -> str | None:
    """The Alembic revision the database is at (`None` before the first migration)."""

    def read(connection: sa.Connection) -> str | None:
        from alembic.runtime.migration import MigrationContext

        return MigrationContext.configure(connection).get_current_revision()

    return await conn.run_sync(read)
