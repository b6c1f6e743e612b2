"""Usage retention, on SQLite and PostgreSQL: usage older than the retention is deleted, a
slice per statement, by every catalog at once without harm; the newer is kept, and a batch
sent again within it still counts once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from shoal.catalog import CatalogClient, CatalogConfig, CatalogServer, migrate, open_engine, tables
from shoal.catalog import usage as usage_module
from shoal.catalog.usage import UsageBatch, UsageRetention, prune_usage, record_batch
from tests.catalog.test_usage import row
from tests.helpers import wait_for

NOW = datetime.now(UTC).replace(second=0, microsecond=0)


def minute(days_ago: float, n: int = 0) -> str:
    return (NOW - timedelta(days=days_ago, minutes=n)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = open_engine(database_url)
    await migrate(engine)
    yield engine
    await engine.dispose()


async def old_rows(engine: AsyncEngine, count: int, days_ago: float) -> None:
    """`count` usage rows of distinct minutes `days_ago`, and as many batch ids received then."""
    at = NOW - timedelta(days=days_ago)
    async with engine.begin() as conn:
        await conn.execute(sa.insert(tables.usage), [
            {"workspace": "team-a", "key": "k", "model": "m", "served_model": "m",
             "status_class": "2xx", "minute": at - timedelta(minutes=i), "requests": 1,
             "prompt_tokens": 0, "completion_tokens": 0} for i in range(count)
        ])  # fmt: skip
        await conn.execute(
            sa.insert(tables.usage_batches),
            [{"batch_id": f"old-{days_ago}-{i:06d}", "received_at": at} for i in range(count)],
        )


async def counts(engine: AsyncEngine) -> tuple[int, int]:
    async with engine.connect() as conn:
        rows = (await conn.execute(sa.select(sa.func.count()).select_from(tables.usage))).scalar()
        batches = await conn.execute(sa.select(sa.func.count()).select_from(tables.usage_batches))
        return int(rows or 0), int(batches.scalar() or 0)


@pytest.fixture
async def client(database_url: str) -> AsyncIterator[CatalogClient]:
    """A catalog that prunes nothing by itself (the tests prune)."""
    server = CatalogServer(CatalogConfig(database_url, port=0, usage_retention_days=0))
    await server.start()
    try:
        async with CatalogClient(server.url, workspace="team-a") as client:
            yield client
    finally:
        await server.stop()


async def test_usage_older_than_the_retention_is_deleted_and_the_newer_kept(
    engine: AsyncEngine, client: CatalogClient
) -> None:
    await old_rows(engine, 3, days_ago=100)
    recent = {"batch_id": "recent-0001", "rows": [row("a", "chat", minute(10), 2)]}
    assert await client.record_usage(recent)
    assert await counts(engine) == (4, 4)
    assert await prune_usage(engine, NOW - timedelta(days=90)) == 6
    assert await counts(engine) == (1, 1)
    assert [(i["key"], i["requests"]) for i in await client.usage()] == [("a", 2)]
    assert not await client.record_usage(recent)  # sent again: its id was kept, not counted
    assert [i["requests"] for i in await client.usage()] == [2]


async def test_a_large_backlog_is_deleted_a_bounded_slice_per_statement(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(usage_module, "PRUNE_SLICE", 100)
    await old_rows(engine, 1_050, days_ago=400)
    deletes: list[int] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            deletes.append(cursor.rowcount)

    sa.event.listen(engine.sync_engine, "after_cursor_execute", count)
    try:
        assert await prune_usage(engine, NOW - timedelta(days=90)) == 2_100
    finally:
        sa.event.remove(engine.sync_engine, "after_cursor_execute", count)
    assert await counts(engine) == (0, 0)
    assert max(deletes) == 100 and len(deletes) == 2 * 11  # (10 full slices and the rest, twice)


async def test_two_catalogs_pruning_at_once_delete_each_row_once(
    database_url: str, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(usage_module, "PRUNE_SLICE", 200)
    await old_rows(engine, 2_000, days_ago=100)
    other = open_engine(database_url)
    try:
        before = NOW - timedelta(days=90)
        done = await asyncio.gather(prune_usage(engine, before), prune_usage(other, before))
    finally:
        await other.dispose()
    assert await counts(engine) == (0, 0)
    assert sum(done) == 4_000  # (no row counted twice, none left)


async def test_a_catalog_prunes_as_it_runs_and_reports_the_pruning(database_url: str) -> None:
    config = CatalogConfig(database_url, port=0, usage_retention_days=30, usage_prune_interval=0.05)
    server = CatalogServer(config)
    await server.start()
    try:
        async with CatalogClient(server.url, workspace="team-a") as client:
            old = {"batch_id": "late-0001", "rows": [row("a", "chat", minute(45), 5)]}
            new = {"batch_id": "late-0002", "rows": [row("b", "chat", minute(1), 1)]}
            assert await client.record_usage(old) and await client.record_usage(new)

            async def pruned() -> bool:
                return [i["key"] for i in await client.usage()] == ["b"]

            await wait_for(pruned, message="the 45-day-old usage deleted")
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{server.url}/health/controllers") as resp,
        ):
            assert resp.status == 200
            report = (await resp.json())["usage_retention"]
        assert report["days"] == 30 and report["deleted"] >= 1 and report["error"] == ""
        assert report["last_pass"] is not None
    finally:
        await server.stop()


async def test_a_retention_longer_than_the_calendar_deletes_nothing_and_reports_no_error(
    engine: AsyncEngine,
) -> None:
    await old_rows(engine, 2, days_ago=100)
    retention = UsageRetention(engine, days=1e9)  # (a cutoff before year 1: OverflowError)
    await retention.prune_once()
    assert retention.error == "" and await counts(engine) == (2, 2)


class FailingEngine:
    """An engine whose `connect` fails from the `fail_at`-th call on (the database went
    away in the middle of a pass), or raises `once` at that call only."""

    def __init__(self, engine: AsyncEngine, fail_at: int, once: Exception | None = None) -> None:
        self.engine, self.fail_at, self.once, self.calls = engine, fail_at, once, 0

    def connect(self) -> Any:
        self.calls += 1
        if self.calls == self.fail_at and self.once is not None:
            raise self.once
        if self.calls >= self.fail_at and self.once is None:
            raise ConnectionError("the database went away")
        return self.engine.connect()


async def test_a_pass_that_fails_part_way_reports_the_slices_it_deleted(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each slice commits on its own, but the report added a pass's count only when the
    whole pass ended: a pass that failed after 20,000 of 40,000 reported none of them."""
    monkeypatch.setattr(usage_module, "PRUNE_SLICE", 100)
    await old_rows(engine, 350, days_ago=100)
    retention = UsageRetention(FailingEngine(engine, fail_at=3), days=90)  # type: ignore[arg-type]
    await retention.prune_once()
    assert "went away" in retention.report()["error"]
    left = await counts(engine)
    assert retention.report()["deleted"] == 350 - left[0] == 200


class Deadlock(Exception):
    sqlstate = "40P01"


async def test_a_slice_that_loses_a_deadlock_runs_again_and_the_pass_goes_on(
    engine: AsyncEngine,
) -> None:
    """On PostgreSQL a pass deadlocked with a batch adding to old rows (other lock orders):
    the whole pass was given up for an hour. A deadlock's victim runs again."""
    await old_rows(engine, 30, days_ago=100)
    lost = sa.exc.OperationalError("DELETE ...", {}, Deadlock("deadlock detected"))
    retention = UsageRetention(FailingEngine(engine, fail_at=1, once=lost), days=90)  # type: ignore[arg-type]
    await retention.prune_once()
    assert retention.report()["error"] == ""
    assert await counts(engine) == (0, 0) and retention.report()["deleted"] == 60


async def test_batches_sharing_rows_in_other_orders_are_all_counted(
    engine: AsyncEngine,
) -> None:
    """Two frontends' batches adding to the same rows, listed in other orders, deadlocked on
    PostgreSQL (25 of 60 failed): rows are written in one order, and a victim runs again."""
    minutes = [minute(0, n) for n in range(300)]
    batches = []
    for i in range(12):
        rows = [row("k", "m", m, 1) for m in (minutes if i % 2 else minutes[::-1])]
        batches.append(UsageBatch.model_validate({"batch_id": f"batch-{i:04d}", "rows": rows}))
    counted = await asyncio.gather(*(record_batch(engine, batch) for batch in batches))
    assert all(counted)
    async with engine.connect() as conn:
        total = await conn.execute(sa.select(sa.func.sum(tables.usage.c.requests)))
        assert total.scalar() == 12 * 300
