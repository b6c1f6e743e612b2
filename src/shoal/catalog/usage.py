"""Usage of API keys: the frontends' batches added up per minute, and the queries over them.

`POST /v1/usage` takes one batch of a frontend, `{batch_id, rows}`, each row the requests and
tokens of one (workspace, key, model, served model, status class, minute). The batch id is
inserted in the same transaction as the rows are added: a batch sent again (its answer was
lost, the frontend retried) finds its id taken and adds nothing, so nothing is counted twice.
`GET /v1/workspaces/{ws}/usage?key=&model=&from=&to=&group_by=key|model|minute` sums them.
No `from __future__ import annotations` here: FastAPI reads the routes' annotations.
"""

import asyncio
import functools
import logging
import pathlib
import random
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import sqlalchemy as sa
from fastapi import FastAPI, Path, Query, Response
from pydantic import BaseModel, Field, field_validator
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from shoal.catalog import tables
from shoal.catalog.errors import InvalidError
from shoal.catalog.repository import check_storable
from shoal.catalog.resources import WORKSPACE_PATTERN, Strict, Time
from shoal.slices import encode_in_slices

log = logging.getLogger(__name__)

Count = Annotated[int, Field(ge=0, le=10**15, strict=True)]
COUNT_MAX = 2**63 - 1
"""A stored counter's bound (the column is a BIGINT): sums that would pass it (a batch
repeating one row thousands of times, batches adding to one minute) stay at it. Refusing
them would refuse the whole batch, every other key's rows in it too."""
Label = Annotated[str, Field(max_length=400, pattern=r"^[^\x00]*$")]


class UsageRow(Strict):
    workspace: Annotated[str, Field(min_length=1, max_length=63, pattern=WORKSPACE_PATTERN)]
    key: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\x00]+$")]
    model: Label
    served_model: Label = ""
    status_class: Literal["2xx", "3xx", "4xx", "5xx"]
    minute: Time
    requests: Count
    prompt_tokens: Count = 0
    completion_tokens: Count = 0

    @field_validator("minute")
    @classmethod
    def _whole_minute(cls, value: datetime) -> datetime:
        value = value if value.tzinfo else value.replace(tzinfo=UTC)
        try:
            return value.astimezone(UTC).replace(second=0, microsecond=0)
        except OverflowError as exc:  # "0001-01-01T00:00:00+01:00": before year 1 in UTC
            raise ValueError(f"{value.isoformat()} is out of range in UTC") from exc


class UsageBatch(Strict):
    batch_id: Annotated[str, Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    rows: list[UsageRow] = Field(max_length=100_000)

    validated_in_slices: ClassVar[str] = "rows"
    """A large batch's rows are decoded and validated on the loop a slice at a time
    (`shoal.catalog.body_slices`): no validator here reads `rows` beside another field."""


class BatchResult(BaseModel):
    batch_id: str
    counted: bool = Field(description="false: this batch was counted before (a retry)")
    rows: int


class UsageItem(BaseModel):
    key: str | None = None
    model: str | None = None
    minute: datetime | None = None
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class UsageReport(BaseModel):
    workspace: str
    group_by: str
    items: list[UsageItem]


DEADLOCK_ATTEMPTS = 5
"""Times a transaction PostgreSQL rolled back as a deadlock (or serialization failure) is
run: two writers of the same rows in other orders (a frontend's late batch and the
retention's delete) lose one of them, whose work is whole to run again."""


def _deadlocked(exc: BaseException) -> bool:
    code = getattr(getattr(exc, "orig", None), "sqlstate", None)
    return code in ("40P01", "40001")


async def _again_if_deadlocked(write: Callable[[], Awaitable[Any]]) -> Any:
    """`write()` (one transaction), again after a short random wait if it was the victim of
    a deadlock, up to `DEADLOCK_ATTEMPTS` times."""
    for attempt in range(1, DEADLOCK_ATTEMPTS + 1):
        try:
            return await write()
        except sa.exc.DBAPIError as exc:
            if not _deadlocked(exc) or attempt == DEADLOCK_ATTEMPTS:
                raise
            log.info("usage: a transaction lost a deadlock, again (attempt %d)", attempt + 1)
            await asyncio.sleep(random.uniform(0.01, 0.05) * attempt)
    raise AssertionError("unreachable")


async def record_batch(engine: AsyncEngine, batch: UsageBatch) -> bool:
    """Add `batch`'s rows unless its id was counted before; True if counted now."""
    rows = await asyncio.to_thread(_merged, batch.rows)  # ~4,500 rows in 1 MiB
    result: bool = await _again_if_deadlocked(lambda: _record(engine, batch.batch_id, rows))
    return result


async def _record(engine: AsyncEngine, batch_id: str, rows: list[dict[str, Any]]) -> bool:
    insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
    u = tables.usage
    async with engine.connect() as conn:
        await conn.execution_options(shoal_write=True)
        async with conn.begin():
            taken = await conn.execute(
                insert(tables.usage_batches)
                .values(batch_id=batch_id, received_at=datetime.now(UTC))
                .on_conflict_do_nothing(index_elements=["batch_id"])
            )
            if taken.rowcount != 1:
                return False
            if not rows:
                return True
            stmt = insert(u)
            upsert = stmt.on_conflict_do_update(
                index_elements=["workspace", "key", "model", "served_model", "status_class",
                                "minute"],
                set_={
                    name: _added(u.c[name], stmt.excluded[name])
                    for name in ("requests", "prompt_tokens", "completion_tokens")
                },
            )  # fmt: skip
            # executemany in slices: their parameters are bound on the loop, free between
            for start in range(0, len(rows), WRITE_SLICE):
                await conn.execute(upsert, rows[start : start + WRITE_SLICE])
    return True


WRITE_SLICE = 500  # rows bound per statement (a 1 MiB batch is ~4,500 rows)


def _added(held: sa.ColumnElement[int], more: sa.ColumnElement[int]) -> sa.ColumnElement[int]:
    """`held + more`, at most `COUNT_MAX`, never computing past it (PostgreSQL's BIGINT
    raises "out of range", SQLite's integer turns REAL)."""
    bound = sa.literal(COUNT_MAX, sa.BigInteger)
    return sa.case((held > bound - more, bound), else_=held + more)


def _merged(rows: list[UsageRow]) -> list[dict[str, Any]]:
    """The rows with one per identity (a batch may repeat one: they add up), in the order of
    their identities: batches that share rows lock them in one order (in theirs, two
    frontends' batches deadlocked on PostgreSQL). Called in a thread: its Python loop lets
    the event loop take the GIL back, but the sort is one C call that holds it, so it sorts
    strings (no field holds a NUL, so joined at NULs they sort as the identities do): 10,000
    identities as tuples took 9-25 ms, as strings ~1.5 ms."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        data = row.model_dump()
        ident = tuple(data[k] for k in ("workspace", "key", "model", "served_model",
                                        "status_class", "minute"))  # fmt: skip
        held = merged.get(ident)
        if held is None:
            merged[ident] = data
        else:
            for count in ("requests", "prompt_tokens", "completion_tokens"):
                held[count] = min(held[count] + data[count], COUNT_MAX)
    return [merged[ident] for ident in sorted(merged, key=lambda i: "\x00".join(map(str, i)))]


async def query_usage(
    engine: AsyncEngine,
    workspace: str,
    *,
    key: str | None = None,
    model: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    group_by: str = "key",
) -> list[dict[str, Any]]:
    """Sums per `group_by` (key, model or minute) of the rows matching the filters, in order,
    as `UsageItem`s read (`start` inclusive, `end` exclusive). Rows are read in partitions,
    the loop free between them, and made into items in a thread. A value no row can hold
    (NUL in `key` or `model`, a time out of range once in UTC) is `InvalidError` (422),
    never sent to the database (which would fail, answered as its outage)."""
    check_storable(key, "key")
    check_storable(model, "model")
    u = tables.usage
    where: list[sa.ColumnElement[bool]] = [u.c.workspace == workspace]
    if key is not None:
        where.append(u.c.key == key)
    if model is not None:
        where.append(u.c.model == model)
    if start is not None:
        where.append(u.c.minute >= _in_utc(start, "from"))
    if end is not None:
        where.append(u.c.minute < _in_utc(end, "to"))
    column = {"key": u.c.key, "model": u.c.model, "minute": u.c.minute}[group_by]
    sums = _exact_sums(u.c.requests, u.c.prompt_tokens, u.c.completion_tokens)
    query = (
        sa.select(column.label("group"), *sums)
        .where(*where)
        .group_by(column)
        .order_by(column)
        .limit(REPORT_ITEMS + 1)  # (one more: tells a report over its bound)
    )
    rows: list[Any] = []
    async with engine.connect() as conn:
        result = await conn.stream(query)
        async for part in result.partitions(PARTITION):
            rows += part
    if len(rows) > REPORT_ITEMS:  # never cut short in silence: a sum of a part is wrong
        raise InvalidError(
            f"group_by: the report is over {REPORT_ITEMS} items (REPORT_ITEMS); narrow it "
            "with from/to, key or model, or group by a coarser field",
            param="group_by",
        )
    return await asyncio.to_thread(_items, rows, group_by)


def _exact_sums(*counters: sa.Column[Any]) -> list[sa.Label[Any]]:
    """Each counter's sum as two, of its high and low 32 bits (`_summed` adds them up): a
    counter may be at the bigint bound (`COUNT_MAX`), and SQLite's sum() of two such raised
    'integer overflow', failing the whole report as an outage. Each half's sum stays within
    a bigint up to 2**31 rows, and the total is exact, past 2**63, on every database."""
    return [
        part
        for counter in counters
        for part in (
            sa.func.sum(counter.op(">>")(sa.literal_column("32"))).label(f"{counter.name}_high"),
            sa.func.sum(counter.op("&")(sa.literal_column(str(LOW_BITS)))).label(
                f"{counter.name}_low"
            ),
        )
    ]


LOW_BITS = 2**32 - 1


def _summed(row: Any, counter: str) -> int:
    return (int(getattr(row, f"{counter}_high")) << 32) + int(getattr(row, f"{counter}_low"))


REPORT_ITEMS = 100_000
"""A usage report's items, at most (69 days of minutes); over it, the report is refused
(422) rather than answered in part."""


PARTITION = 250  # rows fetched between two turns of the event loop (SQLite parses their dates)


def _items(rows: list[Any], group_by: str) -> list[dict[str, Any]]:
    """The rows as `UsageItem`s (in a thread: a month of minutes is 43,200 of them, and their
    first making, memory growing, held the loop ~100 ms)."""
    items: list[dict[str, Any]] = []
    for row in rows:
        group: Any = row.group
        if group_by == "minute" and isinstance(group, datetime):
            group = _aware(group).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        prompt, completion = _summed(row, "prompt_tokens"), _summed(row, "completion_tokens")
        item: dict[str, Any] = {"key": None, "model": None, "minute": None}
        item[group_by] = group
        item["requests"] = _summed(row, "requests")
        item["prompt_tokens"], item["completion_tokens"] = prompt, completion
        item["total_tokens"] = prompt + completion
        items.append(item)
    return items


PRUNE_SLICE = 5000  # rows deleted per statement (and transaction): no long lock, the loop free


async def prune_usage(
    engine: AsyncEngine, before: datetime, counted: Callable[[int], None] = lambda _: None
) -> int:
    """Delete the usage rows of minutes before `before`, and the ids of batches received
    before it, `PRUNE_SLICE` at a time, each slice its own transaction (again if it lost a
    deadlock to a batch being written), told to `counted` once committed; the count
    deleted. Two catalogs pruning at once delete each slice once between them."""
    deleted = 0
    before = _aware(before)
    for table, column in (
        (tables.usage, tables.usage.c.minute),
        (tables.usage_batches, tables.usage_batches.c.received_at),
    ):
        key = next(iter(table.primary_key.columns))
        oldest = sa.select(key).where(column < before).order_by(column).limit(PRUNE_SLICE)
        statement = sa.delete(table).where(key.in_(oldest))
        while True:
            done: int = await _again_if_deadlocked(functools.partial(_delete, engine, statement))
            deleted += done
            counted(done)
            if done < PRUNE_SLICE:
                break
    return deleted


async def _delete(engine: AsyncEngine, statement: sa.Delete) -> int:
    async with engine.connect() as conn:
        await conn.execution_options(shoal_write=True)
        async with conn.begin():
            result = await conn.execute(statement)
    return int(result.rowcount)


class UsageRetention:
    """Prunes usage older than `days` every `interval` seconds (the first pass at once), for
    as long as it runs; a failed pass is logged and reported, and the next one tries again."""

    def __init__(self, engine: AsyncEngine, days: float, interval: float = 3600.0) -> None:
        self.engine = engine
        self.days = days
        self.interval = interval
        self.deleted = 0  # rows and batch ids deleted since the start
        self.last_pass: datetime | None = None  # the end of the last pass that succeeded
        self.error = ""  # why the last pass failed ("" when it did not)

    async def run(self) -> None:
        while True:
            await self.prune_once()
            await asyncio.sleep(self.interval)

    async def prune_once(self) -> None:
        try:
            try:
                before = datetime.now(UTC) - timedelta(days=self.days)
            except OverflowError:  # (more days than the calendar holds: nothing is that old)
                return
            deleted = await prune_usage(self.engine, before, self._counted)
        except Exception as exc:  # the database is down or refuses: the next pass tries again
            self.error = f"{type(exc).__name__}: {exc}"[:300]
            log.warning("usage retention: pruning failed, next pass in %gs: %s",
                        self.interval, self.error)  # fmt: skip
            return
        self.last_pass, self.error = datetime.now(UTC), ""
        if deleted:
            log.info("usage retention: %d rows and batch ids before %s deleted", deleted,
                     before.strftime("%Y-%m-%dT%H:%M:%SZ"))  # fmt: skip

    def _counted(self, deleted: int) -> None:
        self.deleted += deleted  # (each slice as it commits: a pass that fails keeps its own)

    def report(self) -> dict[str, Any]:
        last = self.last_pass.strftime("%Y-%m-%dT%H:%M:%SZ") if self.last_pass else None
        return {"days": self.days, "deleted": self.deleted, "last_pass": last, "error": self.error}


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _in_utc(moment: datetime, param: str) -> datetime:
    """`moment` in UTC (naive: taken as UTC); `InvalidError` naming `param` when it is out
    of range there ("0001-01-01T00:00:00+01:00" is before year 1, as `UsageRow` refuses)."""
    try:
        return _aware(moment).astimezone(UTC)
    except OverflowError:
        raise InvalidError(
            f"{param}: {moment.isoformat()} is out of range in UTC", param=param
        ) from None


def usage_routes(
    app: FastAPI,
    engine: AsyncEngine,
    read: list[Any],
    write: list[Any],
    responses: dict[int | str, Any],
) -> None:
    """`POST /v1/usage` (a frontend's batch), `GET /v1/workspaces/{ws}/usage`, and the page
    that shows it, `GET /ui/usage` (per key, model or minute; its data needs the admin token
    unless reads are public, as the API does)."""
    common: dict[str, Any] = {"responses": responses, "tags": ["usage"]}
    page = (pathlib.Path(__file__).parent / "static" / "usage.html").read_bytes()

    @app.get("/ui/usage", include_in_schema=False)
    async def usage_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    @app.post(
        "/v1/usage",
        response_model=BatchResult,
        dependencies=write,
        operation_id="record_usage",
        **common,
    )
    async def record(body: UsageBatch) -> BatchResult:
        counted = await record_batch(engine, body)
        return BatchResult(batch_id=body.batch_id, counted=counted, rows=len(body.rows))

    @app.get(
        "/v1/workspaces/{workspace}/usage",
        response_model=UsageReport,
        dependencies=read,
        operation_id="get_usage",
        **common,
    )
    async def report(
        workspace: Annotated[str, Path(min_length=1, max_length=63, pattern=WORKSPACE_PATTERN)],
        key: Annotated[str | None, Query(max_length=200)] = None,
        model: Annotated[str | None, Query(max_length=400)] = None,
        start: Annotated[Time | None, Query(alias="from")] = None,
        end: Annotated[Time | None, Query(alias="to")] = None,
        group_by: Literal["key", "model", "minute"] = "key",
    ) -> Response:
        items = await query_usage(
            engine, workspace, key=key, model=model, start=start, end=end, group_by=group_by
        )
        # Encoded as they are, already what `UsageReport` says (a response model would validate
        # and encode 100,000 items on the loop), a slice at a time: msgspec encodes in one C
        # call holding the GIL, so in a thread 100,000 items held the loop ~20 ms all the same.
        encoded = msgspec.Raw(await encode_in_slices(items))
        report = {"workspace": workspace, "group_by": group_by, "items": encoded}
        return Response(msgspec.json.encode(report), media_type="application/json")
