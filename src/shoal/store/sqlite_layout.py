"""The layout of the SQLite store's file: its tables, the version of their layout, and how a
file of an older one is brought to it at open (`_check_layout`, in the transaction that
opens the file; see `shoal.store.sqlite_file`).

Layout:

- `meta`: one row with the current store `revision`, the `compact_revision` up to which
  the change log has been trimmed, and `log_bytes`, the bytes the log holds (kept by
  triggers on `changes`).
- `kv`: the keys, each with its value, the revisions that created and last wrote it and
  its lease; indexed by lease, and by key with everything but the value (`LISTING_INDEX`:
  a listing of what changed since a revision reads the values of those keys only).
- `leases`: id, TTL, the `boot` that granted or last renewed it and its deadline on that
  boot's monotonic clock (`expires`; see "Lease clock" in `shoal.store.sqlite_leases`).
  `deadline` is a wall-clock deadline: for the leases of version-1 processes still running
  during an upgrade (`boot` empty, judged on it as they were), the generous bound of a lease
  whose boot is unknown, and out of reach for the others, so a version-1 process never
  reaps them.
- `changes`: one row per revision (key, value, NULL for a delete, and `at`, when it was
  written): the log watches read (`shoal.store.sqlite_log`).

Layouts: a new file gets the current one (`SCHEMA_VERSION` 2). A version-1 file is
migrated at open (see `_MIGRATE_FROM_1`), and so is the version-2 layout two development
builds wrote, with no `leases.expires` (`_MIGRATE_FROM_DEV_2`; stop processes of those
builds first: they judge leases differently). A version-2 file lacking any other column,
or a newer version, is refused at open in one line naming what is missing. The change
log's retention adds `changes.at`, `meta.log_bytes` and two triggers to a version-2 file at
open where missing (`sqlite_log.LOG_LAYOUT`; a read-only client needs none of them).
"""

from __future__ import annotations

import sqlite3
import time

from shoal.store.sqlite_leases import OUT_OF_REACH, WALL_CLOCK_SLACK
from shoal.store.sqlite_log import LOG_TRIGGERS, add_log_layout

SCHEMA_VERSION = 2

LISTING_INDEX = "kv_listing"
"""The index of `kv` that holds everything a listing reads but the values: a listing of
what changed since a revision (`get_prefixes_changed`) reads the table row of a key only
for a value it sends. Created at open where missing (it changes nothing else: processes of
the same layout without it maintain it as they write, and never read it)."""
_LISTING_INDEX = (
    f"CREATE INDEX IF NOT EXISTS {LISTING_INDEX} ON kv (key, mod_revision, lease, create_revision)"
)
_SCHEMA = (
    "CREATE TABLE meta (id INTEGER PRIMARY KEY CHECK (id = 0),"
    " revision INTEGER NOT NULL, compact_revision INTEGER NOT NULL,"
    " log_bytes INTEGER NOT NULL DEFAULT 0)",
    "INSERT INTO meta (id, revision, compact_revision) VALUES (0, 0, 0)",
    "CREATE TABLE kv (key TEXT PRIMARY KEY, value BLOB NOT NULL,"
    " mod_revision INTEGER NOT NULL, lease INTEGER NOT NULL DEFAULT 0,"
    " create_revision INTEGER NOT NULL DEFAULT 0)",
    "CREATE INDEX kv_by_lease ON kv (lease)",
    _LISTING_INDEX,
    "CREATE TABLE leases (id INTEGER PRIMARY KEY, ttl REAL NOT NULL, deadline REAL NOT NULL,"
    " boot TEXT NOT NULL DEFAULT '', expires REAL NOT NULL DEFAULT 0)",
    "CREATE INDEX leases_by_deadline ON leases (deadline)",
    "CREATE TABLE changes (revision INTEGER PRIMARY KEY, key TEXT NOT NULL, value BLOB,"
    " at REAL NOT NULL DEFAULT 0)",
    *LOG_TRIGGERS,
)
_COLUMNS = {
    "meta": ("id", "revision", "compact_revision"),
    "kv": ("key", "value", "mod_revision", "lease", "create_revision"),
    "leases": ("id", "ttl", "deadline", "boot", "expires"),
    "changes": ("revision", "key", "value"),
}
"""The columns of each table in the layout of `SCHEMA_VERSION`, checked at open (those of the
change log's retention, `sqlite_log.LOG_LAYOUT`, are added where missing)."""
# From version 1: keys get their create revision (their last write, the best known); the
# leases of version-1 processes keep their wall-clock deadlines until those processes go.
_MIGRATE_FROM_1 = (
    "ALTER TABLE kv ADD COLUMN create_revision INTEGER NOT NULL DEFAULT 0",
    "UPDATE kv SET create_revision = mod_revision",
    "ALTER TABLE leases ADD COLUMN boot TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE leases ADD COLUMN expires REAL NOT NULL DEFAULT 0",
)
# From the layout two development builds wrote as version 2 (no `expires`; `deadline` on
# the monotonic clock of the raw `boot` id, "" where unknown): the deadline moves to
# `expires`, the boot gets its prefix, and the wall-clock bound is set as
# `sqlite_leases._grant` sets it.
_MIGRATE_FROM_DEV_2 = (
    "ALTER TABLE leases ADD COLUMN expires REAL NOT NULL DEFAULT 0",
    "UPDATE leases SET expires = deadline, boot = 'boot:' || boot,"
    f" deadline = CASE WHEN boot = '' THEN :wall + ttl + :slack ELSE {OUT_OF_REACH} END",
)


def _columns(conn: sqlite3.Connection) -> set[str]:
    """The file's columns of the tables of the layout, as `table.column`."""
    return {
        f"{table}.{row[1]}"
        for table in _COLUMNS
        for row in conn.execute(f"PRAGMA table_info({table})")
    }


def _missing_columns(conn: sqlite3.Connection) -> list[str]:
    """What the file lacks of the current layout: `table` or `table.column`, in order."""
    have = _columns(conn)
    missing: list[str] = []
    for table, columns in _COLUMNS.items():
        if not any(c.startswith(table + ".") for c in have):
            missing.append(table)
        else:
            missing.extend(f"{table}.{c}" for c in columns if f"{table}.{c}" not in have)
    return missing


def _check_layout(conn: sqlite3.Connection, read_only: bool) -> None:
    """Create the schema in a new file, or migrate an older one, or refuse in one line."""
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    migration: tuple[str, ...] = ()
    if version == 0:
        migration = _SCHEMA
    elif version == 1:
        migration = _MIGRATE_FROM_1
    elif version == SCHEMA_VERSION:
        missing = _missing_columns(conn)
        if missing == ["leases.expires"]:
            migration = _MIGRATE_FROM_DEV_2
        elif missing:
            raise sqlite3.DatabaseError(
                f"schema version {version} with an unknown layout (missing"
                f" {', '.join(missing)}): not a store file this shoal can use"
            )
    else:
        raise sqlite3.DatabaseError(
            f"schema version {version} is not the supported {SCHEMA_VERSION}"
        )
    if not migration:
        if not read_only:
            conn.execute(_LISTING_INDEX)  # (a file from before the index: built once)
            add_log_layout(conn, _columns(conn))  # (likewise the log's retention)
        return
    if read_only:
        raise sqlite3.DatabaseError(
            "the file is new or needs upgrading to the current layout: open it once without mode=ro"
        )
    params = {"wall": time.time(), "slack": WALL_CLOCK_SLACK}
    for statement in migration:
        conn.execute(statement, params if ":wall" in statement else ())
    conn.execute(_LISTING_INDEX)
    add_log_layout(conn, _columns(conn))
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
