"""Reading and writing catalog rows: versions checked, one query per list or get.

Invariants, both ways:
- a row's `version` is 1 when created and grows by one with every change that alters it; an
  update or delete that names a version other than the row's is refused (409), and an update
  that changes nothing writes nothing and keeps the version (so a converged writer is free);
- a list or a get of rows that exist is exactly one SQL statement (the total rides along as a
  window count); only a miss pays a second one, to tell an unknown workspace from an empty one.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

import msgspec
import sqlalchemy as sa
from pydantic import BaseModel, ValidationError
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from shoal.catalog import tables
from shoal.catalog.errors import CatalogError, ConflictError, InvalidError, NotFoundError
from shoal.catalog.kinds import DEPLOYMENTS, Kind
from shoal.catalog.resources import Meta, Patch, Workspace

log = logging.getLogger(__name__)

SORTABLE = ("name", "created_at", "updated_at", "version")
MAX_PAGE_SIZE = 1000
PAGE_BYTES = 4 << 20  # a list page's encoded items: it ends early past this (>= 1 item)
FETCH_ROWS = 16  # rows decoded and encoded between two yields to the event loop
HISTORY_LIMIT = 100
MAX_LIVE_SECRETS = 16  # a key's secrets not yet ended: each is a grant every frontend holds
KEPT = ("credentials",)  # stored beside the spec; only their own methods change them
R = TypeVar("R")
M = TypeVar("M", bound=Meta)


@dataclass
class Page(Generic[R]):
    items: list[R]
    total: int
    page: int
    page_size: int
    cut: bool = False  # ended early at `PAGE_BYTES`
    next_after: str | None = None  # keyset pages: the name to ask `after=` next, if any

    @property
    def next_page(self) -> int | None:
        if self.cut:
            return None  # the next `page` would skip the items past the cut: use `next_after`
        return self.page + 1 if self.page * self.page_size < self.total else None


def invalid(exc: ValidationError) -> InvalidError:
    """The first validation error as a 422 naming its field (`a.b.0.c`)."""
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    return InvalidError(f"{param or 'body'}: {first['msg']}", param=param)


def check_storable(value: Any, path: str = "") -> None:
    """Refuse what a JSON column cannot hold on every backend: NUL, lone surrogates, NaN and
    infinities. Checked on values as decoded (pydantic's JSON mode turns NaN into null and a
    lone surrogate into U+FFFD), so they are refused naming the field, never changed."""
    if isinstance(value, str):
        if "\x00" in value or (not value.isascii() and _has_surrogate(value)):
            raise InvalidError(
                f"{path}: NUL characters and lone surrogates are refused", param=path
            )
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidError(f"{path}: numbers must be finite", param=path)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_storable(key, path)
            check_storable(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_storable(item, f"{path}.{index}")


def _has_surrogate(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _document(row: sa.Row[Any]) -> dict[str, Any]:
    """A row as the API shows it: its metadata and its fields."""
    return {
        "name": row.name,
        "workspace": row.workspace,
        "version": row.version,
        "created_at": _utc(row.created_at),
        "updated_at": _utc(row.updated_at),
        **row.data,
    }


def _listed(row: sa.Row[Any]) -> bytes:
    """A listed row's JSON as `_document` makes it, its data spliced in as the database
    gives it (`data_text`), never decoded and encoded again: a row costs a copy, however
    many values its free-form fields hold."""
    head = msgspec.json.encode(
        {"name": row.name, "workspace": row.workspace, "version": row.version,
         "created_at": _utc(row.created_at), "updated_at": _utc(row.updated_at)}
    )  # fmt: skip
    fields = row.data_text.strip().removeprefix("{").lstrip()  # a stored object's fields
    return head if fields.startswith("}") else b"%s,%s" % (head[:-1], fields.encode())


def _order(table: sa.Table, sort: str) -> list[sa.ColumnElement[Any]]:
    field = sort.removeprefix("-")
    if field not in SORTABLE:
        raise InvalidError(
            f"sort: one of {', '.join(SORTABLE)}, '-' first for descending", param="sort"
        )
    column = table.c[field]
    order: list[sa.ColumnElement[Any]] = [column.desc() if sort.startswith("-") else column.asc()]
    return order if field == "name" else [*order, table.c.id.asc()]  # names are unique


def _conditions(kind: Kind[Any], filters: dict[str, str]) -> list[sa.ColumnElement[bool]]:
    table = kind.table
    conditions: list[sa.ColumnElement[bool]] = []
    for field, value in filters.items():
        check_storable(value, "filter")
        if field == "name":
            conditions.append(table.c.name == value)
        elif field in kind.filterable:
            conditions.append(table.c.data[field].as_string() == value)
        else:
            choices = ", ".join(sorted({"name", *kind.filterable}))
            raise InvalidError(
                f"filter: {field!r} is not filterable; one of {choices}", param="filter"
            )
    return conditions


class Repository:
    """The catalog's rows in one database; every method is one short transaction."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        dialect = engine.dialect.name
        self._insert = postgresql.insert if dialect == "postgresql" else sqlite.insert

    def _read(self, kind: Kind[M], row: sa.Row[Any]) -> M:
        return read_as(kind, _document(row))

    async def list(
        self,
        kind: Kind[M],
        workspace: str,
        *,
        page: int = 1,
        page_size: int = 100,
        sort: str = "name",
        filters: dict[str, str] | None = None,
        after: str | None = None,
    ) -> Page[msgspec.Raw]:
        """One page of rows, each encoded as the API sends it (stored data is valid: not
        re-validated). With `after` (keyset paging, by name only): the first `page_size` rows
        named after it, so rows deleted or created meanwhile never shift an untouched row out
        of a page. A page ends early once its items pass `PAGE_BYTES` (it holds at least
        one): rows are streamed a few at a time, their data never decoded (`_listed`), so
        the rows past the cut are never read and the event loop is never held; only a keyset page (sort=name, with
        `after` or on page 1) may end early, continued by `Page.next_after`, and any other
        page that would is refused (422)."""
        t = kind.table
        where = [t.c.workspace == workspace, *_conditions(kind, filters or {})]
        counted = sa.select(sa.func.count()).select_from(t).where(*where).scalar_subquery()
        if after is not None:
            check_storable(after, "after")
            if sort != "name":
                raise InvalidError("after: only with sort=name", param="after")
        rows_where = [*where, t.c.name > after] if after is not None else where
        query = (
            sa.select(
                *(c for c in t.c if c.name != "data"),
                sa.cast(t.c.data, sa.Text).label("data_text"),  # spliced in as it is
                counted.label("total"),  # counted once, from the index, not per row
            )
            .where(*rows_where)
            .order_by(*_order(t, sort))
            .limit(page_size)
            .offset((page - 1) * page_size if after is None else 0)
        )
        items: list[msgspec.Raw] = []
        size, total, cut, last = 0, 0, False, ""
        async with self.engine.connect() as conn:
            result = await conn.stream(query)
            async for rows in result.partitions(FETCH_ROWS):
                for row in rows:
                    encoded = _listed(row)
                    if items and size + len(encoded) > PAGE_BYTES:
                        cut = True
                        break
                    items.append(msgspec.Raw(encoded))
                    size, total, last = size + len(encoded), row.total, row.name
                if cut:
                    break
                # (a driver that reads rows ahead, asyncpg, hands over several partitions
                # without a turn of the loop between them: 48 rows in one turn)
                await asyncio.sleep(0)
            await result.close()
            if cut and (sort != "name" or (after is None and page > 1)):
                raise InvalidError(
                    f"page_size: this page's items would pass {PAGE_BYTES} bytes; ask for "
                    "fewer, or page by name (sort=name, after=the last name of each page)",
                    param="page_size",
                )
            if items:
                more = sort == "name" and (cut or len(items) == page_size)
                return Page(items, total, page, page_size, cut, last if more else None)
            await self._require_workspace(conn, workspace)
            if page > 1:
                total = (await conn.execute(sa.select(sa.func.count()).where(*where))).scalar_one()
        return Page([], total, page, page_size)

    async def get(self, kind: Kind[M], workspace: str, name: str) -> M:
        t = kind.table
        query = sa.select(t).where(t.c.workspace == workspace, t.c.name == name)
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
            if row is None:
                await self._require_workspace(conn, workspace)
                raise NotFoundError(f"no {kind.singular} {name!r} in workspace {workspace!r}")
        return self._read(kind, row)

    async def create(
        self,
        kind: Kind[M],
        workspace: str,
        body: BaseModel,
        *,
        kept: dict[str, Any] | None = None,
    ) -> M:
        """Insert `body`; `kept`: fields stored beside the spec that no patch may change (a
        key's credentials)."""
        check_storable(body.model_dump(exclude={"name"}))  # before JSON mode rewrites NaN
        data = body.model_dump(mode="json", exclude={"name"})
        name: str = body.name  # type: ignore[attr-defined]
        data.update(kept or {})
        now = datetime.now(UTC)
        if kind is DEPLOYMENTS:
            data["status_history"] = [_change(data, now)]
        t = kind.table
        values = {"workspace": workspace, "name": name, "version": 1, "data": data}
        try:
            async with self._writing() as conn:
                await self._ensure_workspace(conn, workspace, now)
                await conn.execute(t.insert().values(**values, created_at=now, updated_at=now))
        except IntegrityError as exc:
            raise ConflictError(
                f"{kind.singular} {name!r} already exists in workspace {workspace!r}", param="name"
            ) from exc
        return read_as(kind, {**data, **values, "created_at": now, "updated_at": now})

    async def update(self, kind: Kind[M], workspace: str, name: str, patch: Patch) -> M:
        """Apply `patch` over the row; 409 if `patch.version` is set and not the row's."""
        check_storable(patch.model_dump(exclude_unset=True, exclude={"version"}))
        changes = patch.model_dump(mode="json", exclude_unset=True, exclude={"version"})
        t = kind.table
        async with self._writing() as conn:
            query = sa.select(t).where(t.c.workspace == workspace, t.c.name == name)
            row = (await conn.execute(query.with_for_update())).first()
            if row is None:
                await self._require_workspace(conn, workspace)
                raise NotFoundError(f"no {kind.singular} {name!r} in workspace {workspace!r}")
            _check_version(kind, name, patch.version, row.version)
            old = dict(row.data)
            history = old.pop("status_history", None)
            kept = {k: old.pop(k) for k in KEPT if k in old}
            try:
                new = kind.spec.model_validate({**old, **changes}).model_dump(mode="json")
            except ValidationError as exc:
                if not _over_before(kind, old, exc, changes):
                    raise invalid(exc) from exc
                new = {**old, **changes}  # the row was over a bound in a field left as stored
            if new == old:
                return self._read(kind, row)
            check_storable(new)
            new.update(kept)
            now = datetime.now(UTC)
            if history is not None:
                if (new["status"], new["status_message"]) != (old["status"], old["status_message"]):
                    history = [*history, _change(new, now)][-HISTORY_LIMIT:]
                new["status_history"] = history
            # read as answered before it is written: a row that cannot be is not changed
            updated = read_as(kind, {**new, "name": name, "workspace": workspace,
                "version": row.version + 1, "created_at": _utc(row.created_at),
                "updated_at": now})  # fmt: skip
            done = await conn.execute(
                t.update()
                .where(t.c.id == row.id, t.c.version == row.version)
                .values(data=new, version=row.version + 1, updated_at=now)
            )
            if done.rowcount != 1:
                raise ConflictError(f"{kind.singular} {name!r} changed meanwhile; read it again")
        return updated

    async def delete(self, kind: Kind[Any], workspace: str, name: str, version: int | None) -> None:
        """Delete the row; 409 if `version` is set and not the row's, 404 if there is none."""
        t = kind.table
        where = [t.c.workspace == workspace, t.c.name == name]
        async with self._writing() as conn:
            if version is not None:
                where.append(t.c.version == version)
            done = await conn.execute(t.delete().where(*where))
            if done.rowcount == 1:
                return
            query = sa.select(t.c.version).where(t.c.workspace == workspace, t.c.name == name)
            current = (await conn.execute(query)).scalar()
            if current is None:
                await self._require_workspace(conn, workspace)
                raise NotFoundError(f"no {kind.singular} {name!r} in workspace {workspace!r}")
            _check_version(kind, name, version, current)

    async def rotate_credentials(
        self,
        kind: Kind[M],
        workspace: str,
        name: str,
        credential: dict[str, Any],
        old_valid_until: datetime,
    ) -> M:
        """Add `credential` to the row's credentials; the others end at `old_valid_until` (or
        earlier, if they already did), and those already ended are dropped."""
        t = kind.table
        async with self._writing() as conn:
            query = sa.select(t).where(t.c.workspace == workspace, t.c.name == name)
            row = (await conn.execute(query.with_for_update())).first()
            if row is None:
                await self._require_workspace(conn, workspace)
                raise NotFoundError(f"no {kind.singular} {name!r} in workspace {workspace!r}")
            now = datetime.now(UTC)
            kept: list[dict[str, Any]] = []
            for old in row.data.get("credentials", []):
                ends = old_valid_until
                if old.get("expires_at"):
                    ends = min(ends, _utc(datetime.fromisoformat(old["expires_at"])))
                if ends > now:
                    kept.append({**old, "expires_at": ends.isoformat()})
            if len(kept) >= MAX_LIVE_SECRETS:
                raise ConflictError(
                    f"{kind.singular} {name!r} has {len(kept)} live secrets, the most it may "
                    "have: rotate with an earlier old_valid_until (default: now) to end them"
                )
            data = {**row.data, "credentials": [*kept, credential]}
            await conn.execute(
                t.update()
                .where(t.c.id == row.id)
                .values(data=data, version=row.version + 1, updated_at=now)
            )
        return read_as(kind,
            {**data, "name": name, "workspace": workspace, "version": row.version + 1,
             "created_at": _utc(row.created_at), "updated_at": now}
        )  # fmt: skip

    async def list_workspaces(self, *, page: int = 1, page_size: int = 100) -> Page[Workspace]:
        w = tables.workspaces
        query = (
            sa.select(w, sa.select(sa.func.count()).select_from(w).scalar_subquery().label("total"))
            .order_by(w.c.name)
            .limit(page_size)
            .offset((page - 1) * page_size)
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
            total = rows[0].total if rows else 0
            if not rows and page > 1:
                total = (await conn.execute(sa.select(sa.func.count()).select_from(w))).scalar_one()
        items = [
            Workspace(name=r.name, version=r.version, created_at=_utc(r.created_at)) for r in rows
        ]
        return Page(items, total, page, page_size)

    async def get_workspace(self, name: str) -> Workspace:
        w = tables.workspaces
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(w).where(w.c.name == name))).first()
        if row is None:
            raise NotFoundError(f"no workspace {name!r}", param="workspace")
        return Workspace(name=row.name, version=row.version, created_at=_utc(row.created_at))

    @asynccontextmanager
    async def _writing(self) -> AsyncIterator[AsyncConnection]:
        """A write transaction: it holds the row it read (PostgreSQL: FOR UPDATE) or the
        database (SQLite: BEGIN IMMEDIATE) until it commits, so read-merge-write is atomic."""
        async with self.engine.connect() as conn:
            await conn.execution_options(shoal_write=True)
            async with conn.begin():
                yield conn

    async def _ensure_workspace(self, conn: AsyncConnection, name: str, now: datetime) -> None:
        """Workspaces are created on first use: the first create in one makes it."""
        insert = self._insert(tables.workspaces).values(name=name, version=1, created_at=now)
        await conn.execute(insert.on_conflict_do_nothing(index_elements=["name"]))

    async def _require_workspace(self, conn: AsyncConnection, name: str) -> None:
        w = tables.workspaces
        if (await conn.execute(sa.select(w.c.name).where(w.c.name == name))).first() is None:
            raise NotFoundError(f"no workspace {name!r}", param="workspace")


def read_as(kind: Kind[M], document: dict[str, Any]) -> M:
    """A stored row as its read model; one that is not (a row no bound of today's read
    models foresaw) is an OpenAI-format 500 naming the field, never a bare one."""
    try:
        return kind.read.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "row"
        name = document.get("name")
        log.error("%s %r cannot be read as stored: %s: %s", kind.singular, name, where,
                  first["msg"])  # fmt: skip
        error = CatalogError(
            f"{kind.singular} {name!r} cannot be read as stored: {where}: {first['msg']}",
            param=where,
        )
        error.status, error.type, error.code = 500, "server_error", "stored_row_unreadable"
        raise error from exc


def _over_before(
    kind: Kind[Any], old: dict[str, Any], exc: ValidationError, changes: dict[str, Any]
) -> bool:
    """Whether the merged row fails only where the stored row already failed, in fields the
    patch leaves: a row written before a bound was added (1,000 targets) still takes a patch
    of its other fields (the controller's status), each checked by the patch model."""
    try:
        kind.spec.model_validate(old)
    except ValidationError as before:
        over = {error["loc"][0] for error in before.errors() if error["loc"]}
        return all(
            error["loc"] and error["loc"][0] in over and error["loc"][0] not in changes
            for error in exc.errors()
        )
    return False


def _check_version(kind: Kind[Any], name: str, expected: int | None, actual: int) -> None:
    if expected is not None and expected != actual:
        raise ConflictError(
            f"{kind.singular} {name!r} is at version {actual}, not {expected}; read it again",
            param="version",
        )


def _change(data: dict[str, Any], now: datetime) -> dict[str, Any]:
    return {"status": data["status"], "message": data["status_message"], "at": now.isoformat()}
