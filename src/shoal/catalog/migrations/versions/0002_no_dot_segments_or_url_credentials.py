"""Rows the API now refuses, made valid: names with `.` or `..` segments are renamed, and
credentials in a provider's `base_url` are removed. Each change is logged as a warning.

A name segment `.` becomes `dot` and `..` becomes `dotdot` (`a/../b` → `a/dotdot/b`), with
`-2`, `-3`, ... appended if that name is taken; references to the old name in other rows
(a virtual model's `default_model` or `targets`) are left as they were, for their owner to
update. A `base_url` loses its `user:password@` (the gateway never sent it): its provider
needs an `auth_secret` instead. Both bump the row's `version`.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import hashlib
import logging
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"

KINDS = ("providers", "models", "virtual_models", "deployments")
NAME_LENGTH = 200
log = logging.getLogger("shoal.catalog.migrations")


def _table(name: str) -> sa.TableClause:
    return sa.table(
        name,
        sa.column("id", sa.BigInteger),
        sa.column("workspace", sa.String),
        sa.column("name", sa.String),
        sa.column("version", sa.BigInteger),
        sa.column("updated_at", sa.DateTime(timezone=True)),
        sa.column("data", sa.JSON),
    )


def _without_dot_segments(name: str) -> str:
    renamed = "/".join(
        {".": "dot", "..": "dotdot"}.get(segment, segment) for segment in name.split("/")
    )
    if len(renamed) > NAME_LENGTH - 4:  # room for a `-N` suffix
        renamed = f"renamed-{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    return renamed


def _rename_dot_segments(conn: sa.Connection, kind: str, now: datetime) -> None:
    t = _table(kind)
    dotted = sa.or_(*(t.c.name.like(p) for p in ("%/.", "%/..", "%/./%", "%/../%")))
    rows = conn.execute(sa.select(t.c.id, t.c.workspace, t.c.name, t.c.version).where(dotted))
    for row in rows.all():
        base = _without_dot_segments(row.name)
        new, n = base, 1
        while conn.execute(
            sa.select(t.c.id).where(t.c.workspace == row.workspace, t.c.name == new)
        ).first():
            n += 1
            new = f"{base}-{n}"
        conn.execute(
            t.update()
            .where(t.c.id == row.id)
            .values(name=new, version=row.version + 1, updated_at=now)
        )
        log.warning(
            "catalog migration 0002: %s %s/%s renamed to %r: '.' and '..' name segments are "
            "refused (references to the old name are left as they were)",
            kind, row.workspace, row.name, new,
        )  # fmt: skip


def _without_credentials(url: str) -> str:
    """`url` without the userinfo of its authority (what `urlsplit` calls the netloc), split
    by hand: 0001 stored URLs `urlsplit` refuses (`http://u:p@[::1/v1`), and the migration
    must neither stop on one nor leave its credentials."""
    scheme, sep, rest = url.partition("://")
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    authority = rest[:end]
    if not sep or "@" not in authority:
        return url
    return f"{scheme}{sep}{authority.rpartition('@')[2]}{rest[end:]}"


def _remove_url_credentials(conn: sa.Connection, now: datetime) -> None:
    t = _table("providers")
    for row in conn.execute(sa.select(t.c.id, t.c.workspace, t.c.name, t.c.version, t.c.data)):
        data: dict[str, Any] = dict(row.data)
        url = data.get("base_url")
        if not isinstance(url, str) or (cleaned := _without_credentials(url)) == url:
            continue
        data["base_url"] = cleaned
        conn.execute(
            t.update()
            .where(t.c.id == row.id)
            .values(data=data, version=row.version + 1, updated_at=now)
        )
        log.warning(
            "catalog migration 0002: provider %s/%s: credentials removed from base_url %r "
            "(name the secret holding them in auth_secret)",
            row.workspace, row.name, data["base_url"],
        )  # fmt: skip


def upgrade() -> None:
    conn = op.get_bind()
    now = datetime.now(UTC)
    for kind in KINDS:
        _rename_dot_segments(conn, kind, now)
    _remove_url_credentials(conn, now)


def downgrade() -> None:
    """Nothing to undo: the renamed and cleaned rows are valid at 0001 too."""
