"""`sqlite:///absolute/path.db`: the embedded store, shared by the processes of one host.

Every process opens the same file; SQLite's WAL mode lets readers run beside the one
writer, and every write is one short `BEGIN IMMEDIATE` transaction.

URL: after `sqlite://` come an empty host and the path. `sqlite:///var/x.db` and
`sqlite:////var/x.db` both mean `/var/x.db`; a path that starts with `./` or `../`
(`sqlite:///./x.db`) is relative to the working directory. `%XX` escapes are decoded
(`%20` is a space). The one parameter is `mode`: `?mode=ro` opens the file read-only (it
must exist in the current layout; every write is refused), `?mode=rw` is the default.
Anything else (another parameter, a `#` fragment, `%00`) is refused in one line. Missing
parent directories are created (read-write only).

Layout:

- `meta`: one row with the current store `revision`, the `compact_revision` up to which
  the change log has been trimmed, and `log_bytes`, the bytes the log holds (kept by
  triggers on `changes`).
- `kv`: the keys, each with its value, the revisions that created and last wrote it and
  its lease; indexed by lease, and by key with everything but the value (`LISTING_INDEX`:
  a listing of what changed since a revision reads the values of those keys only).
- `leases`: id, TTL, the `boot` that granted or last renewed it and its deadline on that
  boot's monotonic clock (`expires`; see "Lease clock" below). `deadline` is a wall-clock
  deadline: for the leases of version-1 processes still running during an upgrade (`boot`
  empty, judged on it as they were), the generous bound of a lease whose boot is unknown,
  and out of reach for the others, so a version-1 process never reaps them.
- `changes`: one row per revision (key, value, NULL for a delete, and `at`, when it was
  written): the log watches read (`shoal.store.sqlite_log`).

Each write bumps `meta.revision` and appends its change in the same transaction, so
revisions strictly increase across processes and every change is logged exactly once.
Deleting N keys (revoking a lease) takes N revisions, as in the memory backend, and so does
putting N keys with `put_many`: `PUT_MANY_KEYS` per transaction, paced by the file (a
transaction waits while the change log has no room for it without cutting a change younger
than `RETAIN_SECONDS`; see "Compaction"), and leaving the write lock free between two of
them as long as it held it (`PUT_MANY_SHARE`), so other processes' keepalives get in.

Each store instance owns one connection, used only by a dedicated thread; a whole
transaction runs in one hop to that thread. Background work per instance:

- a watch poller: every `POLL_INTERVAL` (50 ms) it reads `meta` and, only if some watcher
  is behind, the new change rows (`POLL_MAX_CHANGES` at most: a watch further behind gets
  the next slice at once), in one read transaction, and fans them out to all of this
  instance's watches; a watch whose consumer has a slice's worth unread waits for it to
  catch up, then reads on from the log. A watch whose next revision was trimmed, whose
  read failed, or whose client was cut off (`set_unreachable`) gets a `Resync` read in
  that same snapshot. While every watch is served and none was added, a poll reads the
  revision alone; otherwise it looks at its watches `POLL_SLICE` at a time between two
  yields to the event loop (tens of thousands of watches: a frontend following thousands of
  namespaces).
- a lease reaper: every `REAP_INTERVAL` (200 ms) it looks for an expired lease (a read,
  no lock) and only then deletes expired leases and their keys with delete events. Every
  client reaps, so a holder killed by SIGKILL loses its keys within TTL + ~0.25 s. Each
  write transaction also reaps first, so a write never uses an expired lease, and so does
  every read before it reads. Reaping is an optimisation: every read (and a watch's
  `Resync`) leaves out the keys of expired leases itself, so a key whose lease has expired
  is never returned, even by a client that has just opened the file (`shoal ls`) while no
  other process is alive, and a client that cannot write (`mode=ro`, a file it may only
  read, a full disk) still reads. Such a client's watches get no delete events for what
  it cannot reap: each gets a `Resync` without those keys instead (once per newly expired
  lease).

Lease clock. Deadlines are not on the wall clock: a step of the wall clock (NTP, a VM
resumed, an operator's `date -s`) in any one process would otherwise expire every lease in
the file at once, or keep dead ones alive. They are on `CLOCK_MONOTONIC`, which POSIX
defines from a fixed point set at system start: every process of the host reads the same
value, and nothing can step it. SQLite's WAL mode already requires every process using the
file to run on one host, so all of them share that clock. It restarts at each boot, so each
lease also records the boot id (`/proc/sys/kernel/random/boot_id`): a lease from another
boot is expired, since no process survives a reboot. (Leases of version-1 processes still
running during an upgrade keep their wall-clock deadlines until they go.) The assumption: every process using
the file runs on this host in the same time namespace (containers that share the file must
not be given a private `CLOCK_MONOTONIC` offset). Where no boot id is available (not
Linux), the monotonic clock alone cannot tell a reboot (it restarts near 0, so a dead
lease would outlive the reboot by the previous uptime): each lease then also gets a
wall-clock bound, its TTL + `WALL_CLOCK_SLACK` (120 s) after its grant or last renewal.
A dead lease outlives a reboot by that much at most; the price is that a forward step of
the wall clock by more than the slack expires the leases of live holders, which re-grant.
A lease granted without a boot id is judged so by every process, one with a boot id too
(it was taken for another boot's and reaped at once).
A monotonic clock does not count time the host is suspended, so (with a boot id) a
suspend neither expires the leases of live holders nor counts towards the TTL of dead ones.

Layouts: a new file gets the current one (`SCHEMA_VERSION` 2). A version-1 file is
migrated at open (see `_MIGRATE_FROM_1`), and so is the version-2 layout two development
builds wrote, with no `leases.expires` (`_MIGRATE_FROM_DEV_2`; stop processes of those
builds first: they judge leases differently). A version-2 file lacking any other column,
or a newer version, is refused at open in one line naming what is missing. The change
log's retention adds `changes.at`, `meta.log_bytes` and two triggers to a version-2 file at
open where missing (`sqlite_log.LOG_LAYOUT`; a read-only client needs none of them).

The file: an instance follows the file at its path, not the one it opened. If that file is
deleted (a state directory wiped) or replaced (a backup moved in place, a new store made
there after a delete), the instance opens the one at the path within `FILE_CHECK_INTERVAL`
(making it if there is none): what it held in the old file is gone, as from an etcd whose
data directory was lost (a lease holder finds its lease not found and re-puts what it owns),
and its watches get a `Resync`; a listing of what changed since a revision read before
(another history's) reads every value, and a watch from such a revision starts with a
`Resync`. Kept on the old file (whose inode lives on while open), a
worker renewed its lease and listed its keys to itself for good, while every process
opening the path saw another store without them.

Compaction (`shoal.store.sqlite_log`): the change log keeps every change of the last
`RETAIN_SECONDS` (5 s) and the last `RETAIN_CHANGES` (1,000) revisions however old, within
hard caps of `MAX_LOG_CHANGES` (100,000) rows and `MAX_LOG_BYTES` (64 MiB), trimmed every
`TRIM_EVERY` revisions, so its size is bounded whatever the write rate, and writers in
several processes at once (workers re-putting their cards after losing their leases
together) do not write it through before another process's watch reads it. A watcher that
falls behind what it keeps gets a `Resync`, and a listing of what changed since a revision
the log still reaches, `DELTA_CHANGES` back at most, is read from it (`_changes_since`: a
delta, the keys the log names,
whatever the number of keys unchanged; a reconciliation pass over a quiet fleet of 100,000
reads nothing per instance). The WAL is checkpointed automatically
every `WAL_AUTOCHECKPOINT_PAGES` pages and truncated to `JOURNAL_SIZE_LIMIT` afterwards.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import itertools
import logging
import operator
import os
import random
import secrets
import sqlite3
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote, unquote

from shoal.store.base import (
    Delete,
    Event,
    KeyRevision,
    KeyValue,
    LeaseNotFoundError,
    Listing,
    Put,
    Resync,
    Snapshot,
    Store,
    StoreError,
    StoreUnavailableError,
    check_key,
    check_prefix,
    check_value,
    checked_items,
    checked_keys,
    distinct_prefixes,
)
from shoal.store.sqlite_log import (
    LOG_TRIGGERS,
    RETAIN_CHANGES,
    RETAIN_SECONDS,
    TRIM_EVERY,
    add_log_layout,
    append,
    append_many,
    batches,
    wait_for_room,
)
from shoal.urls import redact_url

log = logging.getLogger(__name__)

T = TypeVar("T")

POLL_INTERVAL = 0.05
"""Seconds between two reads of the change log by an instance's watch poller."""
REAP_INTERVAL = 0.2
"""Seconds between two looks for expired leases."""
POLL_MAX_CHANGES = 2048
"""Changes one poll reads at most; a watch further behind is served by the next poll at once
(a slice each: a burst of 30,000 changes is read and fanned out a slice per turn of the
event loop, not in one)."""
POLL_SLICE = 512
"""Watches a poll looks at between two yields to the event loop (24,576 of them, a frontend
swapping 4,096 namespaces, held it up to 1 s per poll)."""
PUT_MANY_SHARE = 0.5
"""The share of the time a `put_many` holds the file's write lock at most: after each of its
transactions it leaves the lock free as long as it held it, so other processes' keepalives
and writes get in between (SQLite's busy handler retries by sleeping, and misses a gap that
is only a turn of the event loop)."""
BUSY_TIMEOUT = 5.0
"""Seconds a statement waits for another process's lock before failing."""
FILE_CHECK_INTERVAL = 1.0
"""Seconds between two looks (one `stat`, in the store thread, before a read or a write) at
whether the file at the store's path is still the one this instance has open (see "The
file" above)."""
WAL_AUTOCHECKPOINT_PAGES = 256
JOURNAL_SIZE_LIMIT = 1024 * 1024
MAX_QUEUED = 10_000
"""Events queued for a watch that is not being read before it is dropped for a `Resync`."""
SCHEMA_VERSION = 2

LISTING_INDEX = "kv_listing"
"""The index of `kv` that holds everything a listing reads but the values: a listing of
what changed since a revision (`get_prefixes_changed`) reads the table row of a key only
for a value it sends. Created at open where missing (it changes nothing else: processes of
the same layout without it maintain it as they write, and never read it)."""
_LISTING_INDEX = (
    f"CREATE INDEX IF NOT EXISTS {LISTING_INDEX} ON kv (key, mod_revision, lease, create_revision)"
)
DELTA_CHANGES = RETAIN_CHANGES + TRIM_EVERY
"""Revisions back a listing of what changed is read from the change log at most, as a delta
(`_changes_since`): it scans them once per prefix. The log may keep up to `MAX_LOG_CHANGES`
(every change of the last `RETAIN_SECONDS`); further back, the listing is whole."""
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
OUT_OF_REACH = 1e300
"""The wall-clock `deadline` of a lease judged on the monotonic clock: never passed."""
# From the layout two development builds wrote as version 2 (no `expires`; `deadline` on
# the monotonic clock of the raw `boot` id, "" where unknown): the deadline moves to
# `expires`, the boot gets its prefix, and the wall-clock bound is set as `_grant` sets it.
_MIGRATE_FROM_DEV_2 = (
    "ALTER TABLE leases ADD COLUMN expires REAL NOT NULL DEFAULT 0",
    "UPDATE leases SET expires = deadline, boot = 'boot:' || boot,"
    f" deadline = CASE WHEN boot = '' THEN :wall + ttl + :slack ELSE {OUT_OF_REACH} END",
)

WALL_CLOCK_SLACK = 120.0
"""Seconds the wall clock may step forward without costing a lease, where the boot is
unknown (see "Lease clock"): a dead lease outlives a reboot by at most its TTL + this."""


def _boot_id() -> str:
    """This boot of the host (Linux), or "" where the system does not say."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


BOOT_ID = _boot_id()
BOOT = "boot:" + BOOT_ID
"""The `boot` of the leases this process grants: never empty (empty marks version 1);
"boot:" where the boot is unknown."""


def lease_clock() -> float:
    """Now on the host's monotonic clock: the clock lease deadlines are kept on."""
    if hasattr(time, "clock_gettime"):
        return time.clock_gettime(time.CLOCK_MONOTONIC)
    return time.monotonic()


def _wall_deadline(ttl: float) -> float:
    """The wall-clock `deadline` of a lease granted or renewed now: out of reach where the
    boot id tells a reboot, else a generous bound that a reboot always passes."""
    if BOOT != "boot:":
        return OUT_OF_REACH
    return time.time() + ttl + WALL_CLOCK_SLACK


_EXPIRED = (
    "(CASE WHEN boot = '' THEN deadline < :wall"
    " ELSE expires < :now OR deadline < :wall"
    " OR (boot != :boot AND :boot != 'boot:' AND boot != 'boot:') END)"
)
"""SQL: the lease has expired, at `_expired_at(now)`. A lease of another boot has: no
process survives a reboot. Where the boot is unknown (`BOOT` is "boot:", to the judge or
to the holder: a sandbox without /proc beside a process with it), the monotonic clock
counts, and the wall-clock bound `_wall_deadline` gave the lease."""

_LIVE = f"(lease = 0 OR lease NOT IN (SELECT id FROM leases WHERE {_EXPIRED}))"
"""SQL, on `kv`: the key's lease (if any) has not expired, at `_expired_at(now)`."""


def _expired_at(now: float) -> dict[str, object]:
    """The parameters of `_EXPIRED` at `now` on the lease clock."""
    return {"now": now, "boot": BOOT, "wall": time.time()}


_URL_USAGE = "use sqlite:///absolute/path.db or sqlite:///./relative/path.db, optionally ?mode=ro"


def _parse_url(url: str) -> tuple[Path, bool]:
    """The file named by `url`, and whether it is opened read-only (`?mode=ro`).

    After `sqlite://` comes an empty host and the path: `sqlite:///var/x.db` and
    `sqlite:////var/x.db` both mean `/var/x.db`; a path that starts `./` or `../` is
    relative to the working directory. `%XX` escapes are decoded. The only parameter is
    `mode` (`ro`, or `rw`, the default); anything else is refused.
    """
    scheme, sep, rest = url.partition("://")
    if scheme != "sqlite" or not sep:
        raise ValueError(f"store URL {redact_url(url)!r}: {_URL_USAGE}")
    if "#" in rest:
        raise ValueError(
            f"store URL {redact_url(url)!r}: a '#' fragment means nothing here; {_URL_USAGE}"
        )
    rest, _, query = rest.partition("?")
    read_only = False
    for param in query.split("&") if query else ():
        name, _, value = param.partition("=")
        if name != "mode" or value not in ("ro", "rw"):
            raise ValueError(
                f"store URL {redact_url(url)!r}: unsupported parameter {name!r} (only mode=ro or mode=rw)"
            )
        read_only = value == "ro"
    try:
        raw = unquote(rest, errors="strict")
    except UnicodeDecodeError:
        raise ValueError(
            f"store URL {redact_url(url)!r}: an escape in the path is not UTF-8"
        ) from None
    if "\0" in raw:
        raise ValueError(f"store URL {redact_url(url)!r}: the path holds a NUL character (%00)")
    if not raw.startswith("/") or not raw.strip("/"):
        raise ValueError(f"store URL {redact_url(url)!r}: {_URL_USAGE}")
    path = raw[1:]
    if path.startswith(("./", "../")):
        return Path(os.path.abspath(path)), read_only
    return Path("/" + path.lstrip("/")), read_only


def _journal_mode_wal(conn: sqlite3.Connection, deadline: float) -> tuple[str]:
    """Switch to WAL. Two processes opening a new file at once can make this fail with
    "database is locked" at once, without the busy handler: retry until `deadline`."""
    while True:
        try:
            row: tuple[str] = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            return row
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.005 + random.random() * 0.02)


def _connect(path: Path, busy_timeout: float, read_only: bool) -> sqlite3.Connection:
    """Open `path` in WAL mode and create the schema if the file is new, or migrate it (in
    the store thread). Read-only: the file must exist in the current layout."""
    if read_only:
        if not path.is_file():
            raise sqlite3.OperationalError(f"no store file {path} (mode=ro opens an existing one)")
        conn = sqlite3.connect(
            f"file:{quote(str(path))}?mode=ro",
            uri=True,
            timeout=busy_timeout,
            isolation_level=None,
            check_same_thread=False,
        )
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
        )
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        if not read_only:
            (mode,) = _journal_mode_wal(conn, time.monotonic() + busy_timeout)
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"cannot switch to WAL journal mode (got {mode!r})")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES}")
            conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
        conn.execute("BEGIN" if read_only else "BEGIN IMMEDIATE")
        try:
            _check_layout(conn, read_only)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT * 1000)}")
    except BaseException:
        conn.close()
        raise
    return conn


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


def _close_unused(future: Future[tuple[sqlite3.Connection, FileId | None]]) -> None:
    """Close a connection whose open finished after the caller gave up on it."""
    if not future.cancelled() and future.exception() is None:
        future.result()[0].close()


FileId = tuple[int, int]
"""A file's device and inode: which file a path names now."""


def _file_id(path: Path) -> FileId | None:
    """The file at `path` now (None: there is none)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _open_file(
    path: Path, busy_timeout: float, read_only: bool
) -> tuple[sqlite3.Connection, FileId | None]:
    """`_connect`, and the file it opened: the one at the path both before and after it
    (looked at after only, a file moved in place in between was taken for the one open, and
    never followed). If they differ, it opens the one there now."""
    for attempt in range(3):
        before = _file_id(path)
        conn = _connect(path, busy_timeout, read_only)
        after = _file_id(path)
        if (before is not None and before == after) or attempt == 2:
            return conn, after
        conn.close()  # (or made by `_connect`: opened again, it is the one looked at before)
    raise AssertionError("unreachable")


# Statements run inside a transaction, in the store thread.


def _value(key: str, value: object) -> bytes | None:
    """A stored value as bytes; None (reported) for one that is not a BLOB, which only a
    hand edit of the file can make: it is skipped, never served and never fatal."""
    if isinstance(value, bytes):
        return value
    log.error("skipping key %r: its stored value is %s, not a BLOB", key, type(value).__name__)
    return None


def _kv(row: tuple[str, object, int, int, int]) -> KeyValue | None:
    key, value, mod_revision, lease, create_revision = row
    data = _value(key, value)
    return None if data is None else KeyValue(key, data, mod_revision, lease, create_revision)


_KV_COLUMNS = "SELECT key, value, mod_revision, lease, create_revision FROM kv"


def _items(conn: sqlite3.Connection, prefix: str, now: float) -> list[KeyValue]:
    """The keys under `prefix` whose lease has not expired at `now`, reaped or not."""
    params = _expired_at(now)
    where = _LIVE
    if prefix:
        # Keys are ASCII (see `check_key`): the range [prefix, prefix with its last
        # character bumped) is exactly the keys that start with prefix, and uses the index.
        params.update(low=prefix, high=prefix[:-1] + chr(ord(prefix[-1]) + 1))
        where = f"key >= :low AND key < :high AND {_LIVE}"
    rows = conn.execute(f"{_KV_COLUMNS} WHERE {where} ORDER BY key", params).fetchall()
    return [kv for start in range(0, len(rows), BUILD_SLICE) for kv in _built(rows, start)]


def _built(rows: list[tuple[str, object, int, int, int]], start: int) -> list[KeyValue]:
    """The `KeyValue`s of `BUILD_SLICE` rows from `start`, built in C loops, and checked in
    one: a value that is not a BLOB only comes from a hand edit of the file."""
    chunk = rows[start : start + BUILD_SLICE]
    items = list(itertools.starmap(KeyValue, chunk))
    if all(map(isinstance, map(_VALUE, items), itertools.repeat(bytes))):
        return items
    return [kv for row in chunk if (kv := _kv(row)) is not None]


BUILD_SLICE = 4096
"""Rows of a listing built into records by one C loop. A C loop holds the GIL to its end:
200,000 of them held it 15-20 ms, the event loop's thread waiting; between two slices the
interpreter may hand it over."""


_VALUE = operator.attrgetter("value")
_SECOND = operator.itemgetter(1)
_ALL_BUT_VALUE = operator.itemgetter(0, 2, 3, 4)


def _has_listing_index(conn: sqlite3.Connection) -> bool:
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = ?", (LISTING_INDEX,)
    ).fetchone()
    return row is not None


def _changed_items(
    conn: sqlite3.Connection, prefix: str, since: int, now: float, indexed: bool
) -> list[KeyValue | KeyRevision]:
    """`_items`, where a key not modified after `since` comes as a `KeyRevision`: with the
    listing index, its table row (its value) is not read at all."""
    params: dict[str, object] = {**_expired_at(now), "since": since}
    where = _LIVE
    if prefix:
        params.update(low=prefix, high=prefix[:-1] + chr(ord(prefix[-1]) + 1))
        where = f"key >= :low AND key < :high AND {_LIVE}"
    # SQLite reads a table row only for a column the index lacks, and only when it
    # evaluates it: here, for a value changed after `since`.
    index = f" INDEXED BY {LISTING_INDEX}" if indexed else ""
    rows = conn.execute(
        "SELECT key, CASE WHEN mod_revision > :since THEN value END, mod_revision, lease,"
        f" create_revision FROM kv{index} WHERE {where} ORDER BY key",
        params,
    ).fetchall()
    return [kv for start in range(0, len(rows), BUILD_SLICE) for kv in _changed_built(rows, start)]


def _changed_built(
    rows: list[tuple[str, object, int, int, int]], start: int
) -> list[KeyValue | KeyRevision]:
    """`_built`, for `_changed_items`: each row becomes a `KeyRevision` (no value) or a
    `KeyValue`, taken in key order from the two."""
    rows = rows[start : start + BUILD_SLICE]
    omitted = list(map(operator.is_, map(_SECOND, rows), itertools.repeat(None)))
    sent = list(compress(rows, map(operator.not_, omitted)))
    if not all(map(isinstance, map(_SECOND, sent), itertools.repeat(bytes))):
        return [kv for row in rows if (kv := _listed(row)) is not None]
    if not sent:
        return list(itertools.starmap(KeyRevision, map(_ALL_BUT_VALUE, rows)))
    take: dict[bool, Iterator[KeyValue | KeyRevision]] = {
        True: itertools.starmap(KeyRevision, map(_ALL_BUT_VALUE, compress(rows, omitted))),
        False: itertools.starmap(KeyValue, sent),
    }
    return list(map(next, map(take.__getitem__, omitted)))


def _changes_since(
    conn: sqlite3.Connection, prefixes: Sequence[str], since: int, now: float
) -> Listing | None:
    """What changed under `prefixes` (`distinct_prefixes`) since `since`, as a delta
    (`Listing.removed`), read from the change log; None when the log does not reach back
    to `since` (trimmed past it, or a file whose revision is behind it: another file), or
    `since` is more than `DELTA_CHANGES` revisions back.

    Read: the keys the log names after `since` (at most `DELTA_CHANGES` revisions: a
    bounded read whatever the fleet's size), the live rows of those, and the
    keys whose lease has expired but that are not reaped yet (a client that cannot write).
    A reader that held every key at `since` holds every key now once it applies them."""
    revision, compacted = conn.execute(
        "SELECT revision, compact_revision FROM meta WHERE id = 0"
    ).fetchone()
    if since < compacted or since > revision or revision - since > DELTA_CHANGES:
        return None
    items: list[KeyValue | KeyRevision] = []
    gone: set[str] = set()
    for prefix in prefixes:
        params: dict[str, object] = {**_expired_at(now), "since": since}
        where = "1"
        if prefix:
            params.update(low=prefix, high=prefix[:-1] + chr(ord(prefix[-1]) + 1))
            where = "key >= :low AND key < :high"
        written = conn.execute(
            f"SELECT DISTINCT key FROM changes WHERE revision > :since AND {where}", params
        ).fetchall()
        if not written:
            continue
        rows = conn.execute(
            f"{_KV_COLUMNS} WHERE {where} AND {_LIVE} AND key IN"
            f" (SELECT key FROM changes WHERE revision > :since AND {where}) ORDER BY key",
            params,
        ).fetchall()
        live = [kv for row in rows if (kv := _kv(row)) is not None]
        items.extend(live)
        gone.update(key for (key,) in written)
        gone.difference_update(kv.key for kv in live)
    for prefix in prefixes:  # (the keys of expired leases not reaped: gone)
        params = _expired_at(now)
        where = f"lease != 0 AND lease IN (SELECT id FROM leases WHERE {_EXPIRED})"
        if prefix:
            params.update(low=prefix, high=prefix[:-1] + chr(ord(prefix[-1]) + 1))
            where += " AND key >= :low AND key < :high"
        gone.update(key for (key,) in conn.execute(f"SELECT key FROM kv WHERE {where}", params))
    return Listing(items, revision, removed=sorted(gone))


def _listed(row: tuple[str, object, int, int, int]) -> KeyValue | KeyRevision | None:
    """A row of `_changed_items`: its value left out (None), or `_kv`."""
    key, value, mod_revision, lease, create_revision = row
    if value is None:
        return KeyRevision(key, mod_revision, lease, create_revision)
    return _kv(row)


def _items_under(conn: sqlite3.Connection, prefixes: tuple[str, ...], now: float) -> list[KeyValue]:
    """`_items` of each of `prefixes` (`distinct_prefixes`: sorted, none inside another), so
    the ranges are disjoint and in key order: together they are sorted."""
    return [kv for prefix in prefixes for kv in _items(conn, prefix, now)]


def _revision(conn: sqlite3.Connection) -> int:
    (revision,) = conn.execute("SELECT revision FROM meta WHERE id = 0").fetchone()
    return int(revision)


def _delete_key(conn: sqlite3.Connection, now: float, key: str) -> int | None:
    if conn.execute("DELETE FROM kv WHERE key = ?", (key,)).rowcount == 0:
        return None
    return append(conn, now, key, None)


def _end_lease(conn: sqlite3.Connection, now: float, lease_id: int) -> None:
    if not lease_id:
        return
    conn.execute("DELETE FROM leases WHERE id = ?", (lease_id,))
    keys = conn.execute("SELECT key FROM kv WHERE lease = ? ORDER BY key", (lease_id,)).fetchall()
    for (key,) in keys:
        _delete_key(conn, now, key)


def _reap(conn: sqlite3.Connection, now: float) -> None:
    expired = conn.execute(f"SELECT id FROM leases WHERE {_EXPIRED}", _expired_at(now)).fetchall()
    for (lease_id,) in expired:
        log.debug("lease %x expired", lease_id)
        _end_lease(conn, now, lease_id)


def _lease_exists(conn: sqlite3.Connection, lease_id: int) -> bool:
    return conn.execute("SELECT 1 FROM leases WHERE id = ?", (lease_id,)).fetchone() is not None


def _put(conn: sqlite3.Connection, now: float, key: str, value: bytes, lease: int) -> int | None:
    if lease and not _lease_exists(conn, lease):
        return None
    revision = append(conn, now, key, value)
    conn.execute(_UPSERT, (key, value, revision, lease, revision))
    return revision


_UPSERT = (
    "INSERT INTO kv (key, value, mod_revision, lease, create_revision) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (key) DO UPDATE SET value = excluded.value,"
    " mod_revision = excluded.mod_revision, lease = excluded.lease"
)


def _put_many(
    conn: sqlite3.Connection, now: float, items: Sequence[tuple[str, bytes]], lease: int
) -> tuple[int, float] | None:
    """`_put` of each of `items` (a `sqlite_log.batches` slice), each at a revision of its
    own, in three statements: the revisions taken at once, then the log and the keys written
    by `executemany`. Returns the last revision, or (0, seconds to wait) when the change log
    has no room for them yet (`wait_for_room`): nothing is written."""
    if lease and not _lease_exists(conn, lease):
        return None
    size = sum(len(key) + len(value) for key, value in items)
    if (wait := wait_for_room(conn, now, len(items), size)) > 0:
        return 0, wait
    logged = append_many(conn, now, _revision(conn) + 1, items)
    conn.executemany(
        _UPSERT, [(key, value, revision, lease, revision) for revision, key, value in logged]
    )
    return logged[-1][0], 0.0


def _create(
    conn: sqlite3.Connection, now: float, key: str, value: bytes, lease: int
) -> bool | None:
    if conn.execute("SELECT 1 FROM kv WHERE key = ?", (key,)).fetchone() is not None:
        return False
    if lease and not _lease_exists(conn, lease):
        return None
    revision = _revision(conn) + 1
    inserted = conn.execute(
        "INSERT INTO kv (key, value, mod_revision, lease, create_revision) VALUES (?, ?, ?, ?, ?)"
        " ON CONFLICT (key) DO NOTHING",
        (key, value, revision, lease, revision),
    ).rowcount
    if inserted != 1:
        return False
    append(conn, now, key, value)
    return True


def _delete(conn: sqlite3.Connection, now: float, key: str) -> bool:
    return _delete_key(conn, now, key) is not None


def _delete_many(
    conn: sqlite3.Connection, now: float, keys: Sequence[str]
) -> tuple[int, int, float]:
    """`_delete` of each of `keys` (a `sqlite_log.batches` slice), each at a revision of its
    own. Returns the keys deleted and the last revision, or (0, 0, seconds to wait) when the
    change log has no room for them yet (`wait_for_room`): nothing is deleted."""
    if (wait := wait_for_room(conn, now, len(keys), sum(map(len, keys)))) > 0:
        return 0, 0, wait
    deleted = revision = 0
    for key in keys:
        if (done := _delete_key(conn, now, key)) is not None:
            deleted, revision = deleted + 1, done
    return deleted, revision, 0.0


def _grant(conn: sqlite3.Connection, now: float, ttl: float) -> int:
    while True:
        lease_id = secrets.randbits(62) + 1
        inserted = conn.execute(
            "INSERT INTO leases (id, ttl, deadline, boot, expires) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO NOTHING",
            (lease_id, ttl, _wall_deadline(ttl), BOOT, now + ttl),
        ).rowcount
        if inserted == 1:
            return lease_id


def _keepalive(conn: sqlite3.Connection, now: float, lease_id: int, ttl: float) -> bool:
    # Expired leases were reaped at the start of this transaction.
    updated = conn.execute(
        "UPDATE leases SET ttl = ?, deadline = ?, boot = ?, expires = ? WHERE id = ?",
        (ttl, _wall_deadline(ttl), BOOT, now + ttl, lease_id),
    ).rowcount
    return bool(updated == 1)


def _revoke(conn: sqlite3.Connection, now: float, lease_id: int) -> None:
    _end_lease(conn, now, lease_id)


def _nothing(conn: sqlite3.Connection, now: float) -> None:
    return None


@dataclass(frozen=True, slots=True)
class _PollResult:
    revision: int
    through: int  # the changes read go up to this revision (`revision`, or a slice's end)
    resyncs: dict[int, list[KeyValue]]
    changes: list[tuple[int, str, bytes | None]]


class _Changes:
    """The changes one poll read, found by key: a watch gets those under its prefixes in
    O(log n) each, not by matching every change against every watch (a frontend following
    4,096 namespaces watches 8,192 prefixes; 1,000 changes held the event loop ~0.3 s)."""

    def __init__(self, changes: list[tuple[int, str, bytes | None]]) -> None:
        self._changes = changes
        self._by_key = sorted(range(len(changes)), key=lambda i: changes[i][1])
        self._keys = [changes[i][1] for i in self._by_key]

    def under(self, prefixes: tuple[str, ...]) -> list[tuple[int, str, bytes | None]]:
        """The changes under any of `prefixes` (`distinct_prefixes`), in revision order."""
        if not self._changes:
            return []
        found: list[int] = []
        for prefix in prefixes:
            if not prefix:
                return self._changes
            # Keys are ASCII (`check_key`): the keys under `prefix` sort in one run.
            high = prefix[:-1] + chr(ord(prefix[-1]) + 1)
            lo = bisect.bisect_left(self._keys, prefix)
            found.extend(self._by_key[lo : bisect.bisect_left(self._keys, high, lo)])
        found.sort()
        return [self._changes[i] for i in found]


@dataclass(eq=False)
class _Watcher:
    prefixes: tuple[str, ...]
    next_revision: int
    epoch: int
    queue: asyncio.Queue[Event | StoreError | None] = field(default_factory=asyncio.Queue)
    resync: bool = False


class SQLiteStore(Store):
    """The store in one SQLite file shared by the processes of a host. Open with `open`."""

    def __init__(
        self,
        url: str,
        path: Path,
        conn: sqlite3.Connection,
        executor: ThreadPoolExecutor,
        read_only: bool = False,
    ) -> None:
        super().__init__()
        self.url = url
        self.path = path
        self.read_only = read_only
        # Expired leases this instance found and could not reap (see `_reap_forever`).
        self._unreaped: frozenset[int] = frozenset()
        self._conn = conn
        # The file `_conn` has open, and when the store thread last looked that it is still
        # the one at `path` (`_follow_file`).
        self._file: FileId | None = None
        self._file_checked = time.monotonic()
        # The lowest revision a listing of what changed may start from, and a watch from
        # (beyond it): one read before the store followed its path to another file is of
        # another history (`_follow_file`).
        self._since_floor = 0
        # Whether the file has `LISTING_INDEX` (looked up by the first listing that uses it).
        self._listing_index: bool | None = None
        self._executor = executor
        self._closed = False
        self._unreachable = False
        # Bumped when every watch must resync (an outage starts, another file is followed,
        # leases expired that this client cannot reap): watches from before it resync.
        self._epoch = 0
        self._watchers: set[_Watcher] = set()
        # Bumped when a watch is added (it needs a poll that no new revision brings). With
        # `_caught_up`, (revision, epoch, `_due`) of the last poll that left every watch
        # served and nothing due: the next polls read only the revision until it moves.
        self._due = 0
        self._caught_up: tuple[int, int, int] | None = None
        self._wake = asyncio.Event()
        self._poller = asyncio.create_task(self._poll_forever(), name=f"sqlite-watch {path}")
        self._poller.add_done_callback(self._poller_ended)
        self._reaper = asyncio.create_task(self._reap_forever(), name=f"sqlite-reaper {path}")

    @classmethod
    async def open(cls, url: str, *, connect_timeout: float = 5.0) -> SQLiteStore:
        """Open (creating if needed) the file named by `url`, failing within `connect_timeout`."""
        path, read_only = _parse_url(url)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-sqlite")
        busy = max(0.05, min(BUSY_TIMEOUT, connect_timeout / 2))
        future = executor.submit(_open_file, path, busy, read_only)
        try:
            conn, file = await asyncio.wait_for(asyncio.wrap_future(future), connect_timeout)
        except TimeoutError:
            future.add_done_callback(_close_unused)
            executor.shutdown(wait=False, cancel_futures=True)
            raise StoreUnavailableError(
                f"store {url} could not be opened within {connect_timeout}s (locked?)"
            ) from None
        except (OSError, sqlite3.Error) as exc:
            executor.shutdown(wait=False)
            raise StoreUnavailableError(f"store {url} cannot be opened: {exc}") from exc
        except BaseException:
            future.add_done_callback(_close_unused)
            executor.shutdown(wait=False)
            raise
        store = cls(url, path, conn, executor, read_only)
        store._file = file
        return store

    # Plumbing.

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError(f"store {self.url} is closed")
        if self._unreachable:
            raise StoreUnavailableError(f"store {self.url} is unreachable")

    def set_unreachable(self, unreachable: bool) -> None:
        """Test seam (see `Store.set_unreachable`): this client loses (or regains) its store.

        While cut off, its calls fail and its watches read nothing; when it comes back, each
        of its watches yields a `Resync`, as after a dropped connection.
        """
        if unreachable and not self._unreachable:
            self._epoch += 1
        self._unreachable = unreachable
        if not unreachable:
            self._wake.set()
        self._watch_state(
            StoreUnavailableError(f"store {self.url} is unreachable") if unreachable else None
        )

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run `fn` in the store thread."""
        self._check_open()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn)
        except (sqlite3.Error, OSError) as exc:  # (OSError: the path, looked at or made)
            raise StoreUnavailableError(f"store {self.url}: {exc}") from exc
        except RuntimeError as exc:  # the executor was shut down by close()
            raise StoreUnavailableError(f"store {self.url} is closed") from exc

    def _write(self, fn: Callable[[sqlite3.Connection, float], T]) -> T:
        """One write transaction (in the store thread): reap expired leases, then `fn`."""
        if self.read_only:
            raise StoreError(f"store {self.url} is read-only (mode=ro): it cannot be written")
        self._follow_file()
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            now = lease_clock()
            _reap(conn, now)
            result = fn(conn, now)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return result

    def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """One read transaction (in the store thread): a consistent snapshot."""
        self._follow_file()
        conn = self._conn
        conn.execute("BEGIN")
        try:
            result = fn(conn)
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")
        return result

    def _follow_file(self) -> None:
        """(In the store thread.) Every `FILE_CHECK_INTERVAL`: if the file at `path` is not
        the one `_conn` has open (deleted, replaced), open the one there (see "The file")."""
        now = time.monotonic()
        if now - self._file_checked < FILE_CHECK_INTERVAL:
            return
        self._file_checked = now
        file = _file_id(self.path)
        if self._file is None or file == self._file:
            self._file = self._file or file  # (an instance not made by `open`: adopts it)
            return
        conn, file = _open_file(self.path, BUSY_TIMEOUT, self.read_only)
        old, self._conn, self._file = self._conn, conn, file
        with contextlib.suppress(sqlite3.Error):  # (every revision read there is below this)
            self._since_floor = max(self._since_floor, _revision(old) + 1)
        self._listing_index = None
        self._epoch += 1  # (read by the poller between polls: its watches resync)
        old.close()
        log.warning(
            "store %s: the file at %s is not the one open (deleted or replaced): opened the "
            "one there now; what this process held in the old one is gone",
            self.url,
            self.path,
        )

    # Reads and writes.

    async def get_prefix(self, prefix: str) -> Snapshot:
        check_prefix(prefix)
        return await self.get_prefixes((prefix,))

    async def get_prefixes(
        self, prefixes: Sequence[str], *, on_answer: Callable[[], None] | None = None
    ) -> Snapshot:
        distinct = distinct_prefixes(prefixes)

        def read(conn: sqlite3.Connection) -> Snapshot:
            revision = _revision(conn)
            return Snapshot(_items_under(conn, distinct, lease_clock()), revision)

        snap = await self._call(functools.partial(self._read_live, read))
        if on_answer is not None:
            on_answer()
        return snap

    async def get_prefixes_changed(
        self,
        prefixes: Sequence[str],
        since: int,
        *,
        on_answer: Callable[[], None] | None = None,
    ) -> Listing:
        if since <= 0:  # (every value, the default: no revision is below 1)
            return await super().get_prefixes_changed(prefixes, since, on_answer=on_answer)
        distinct = distinct_prefixes(prefixes)

        def read(conn: sqlite3.Connection) -> Listing:
            now = lease_clock()
            # A revision from before the store followed its path to another file: that
            # file's history, not this one's (neither a delta nor a value left out).
            start = since if since >= self._since_floor else 0
            if start and (delta := _changes_since(conn, distinct, start, now)) is not None:
                return delta
            if self._listing_index is None:
                self._listing_index = _has_listing_index(conn)
            revision = _revision(conn)
            items = [
                kv
                for prefix in distinct
                for kv in _changed_items(conn, prefix, start, now, self._listing_index)
            ]
            return Listing(items, revision)

        listing = await self._call(functools.partial(self._read_live, read))
        if on_answer is not None:
            on_answer()
        return listing

    async def get(self, key: str) -> KeyValue | None:
        check_key(key)

        def read(conn: sqlite3.Connection) -> KeyValue | None:
            params = {**_expired_at(lease_clock()), "key": key}
            row = conn.execute(f"{_KV_COLUMNS} WHERE key = :key AND {_LIVE}", params).fetchone()
            return None if row is None else _kv(row)

        return await self._call(functools.partial(self._read_live, read))

    def _read_live(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """A read that never sees a key whose lease has expired. Expired leases are reaped
        (with delete events) first when this client can write; when it cannot (`mode=ro`,
        a file it may only read, a full disk), the read still succeeds: `fn` leaves out
        the keys of expired leases itself (`_LIVE`)."""
        self._reap_if_due()
        return self._read(fn)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        return await self._write_key(_put, "put", key, value, lease)

    async def put_many(self, items: Sequence[tuple[str, bytes]], *, lease: int = 0) -> int:
        """`PUT_MANY_KEYS` keys per write transaction (`sqlite_log.batches`), in the store
        thread, each key at a revision of its own (the change log has a row per revision).
        Paced by the file, not by the call: a transaction waits while the change log has no
        room for it without cutting a change younger than `RETAIN_SECONDS`, so the watches of
        other processes get each key, not a `Resync`, whatever the number of writers; and
        after each, the lock is left free as long as it was held (`PUT_MANY_SHARE`)."""
        checked = await checked_items(items)
        revision = 0
        held = 0.0
        for batch in batches(checked):
            if held:  # (a transaction that waited long for the lock: a poll's rest at most)
                await asyncio.sleep(
                    min(held, POLL_INTERVAL) * (1 - PUT_MANY_SHARE) / PUT_MANY_SHARE
                )
            write = functools.partial(_put_many, items=batch, lease=lease)
            while True:
                started = time.monotonic()
                written = await self._call(functools.partial(self._write, write))
                held = time.monotonic() - started
                if written is None:
                    raise LeaseNotFoundError(f"lease {lease:x} does not exist (put_many)")
                revision, wait = written
                if not wait:
                    break
                await asyncio.sleep(min(wait, RETAIN_SECONDS))
        return revision

    async def delete_many(self, keys: Sequence[str]) -> int:
        """`PUT_MANY_KEYS` deletes per write transaction (`sqlite_log.batches`), each key at
        a revision of its own, paced by the file as `put_many` is."""
        checked = await checked_keys(keys)
        deleted = 0
        held = 0.0
        for batch in batches([(key, b"") for key in checked]):
            if held:  # (a transaction that waited long for the lock: a poll's rest at most)
                await asyncio.sleep(
                    min(held, POLL_INTERVAL) * (1 - PUT_MANY_SHARE) / PUT_MANY_SHARE
                )
            write = functools.partial(_delete_many, keys=[key for key, _ in batch])
            while True:
                started = time.monotonic()
                done, _, wait = await self._call(functools.partial(self._write, write))
                held = time.monotonic() - started
                if not wait:
                    break
                await asyncio.sleep(min(wait, RETAIN_SECONDS))
            deleted += done
        return deleted

    async def create(self, key: str, value: bytes, *, lease: int = 0) -> bool:
        return await self._write_key(_create, "create", key, value, lease)

    async def _write_key(
        self, op: Callable[..., T | None], verb: str, key: str, value: bytes, lease: int
    ) -> T:
        """`op` writes `value` at `key` in a write transaction; its `None` means that `lease`
        does not exist."""
        check_key(key)
        check_value(key, value)
        data = bytes(value)
        result = await self._call(
            functools.partial(self._write, functools.partial(op, key=key, value=data, lease=lease))
        )
        if result is None:
            raise LeaseNotFoundError(f"lease {lease:x} does not exist ({verb} {key!r})")
        return result

    async def delete(self, key: str) -> bool:
        check_key(key)
        return await self._call(functools.partial(self._write, functools.partial(_delete, key=key)))

    async def _grant(self, ttl: float) -> int:
        return await self._call(functools.partial(self._write, functools.partial(_grant, ttl=ttl)))

    async def _keepalive(self, lease_id: int, ttl: float) -> bool:
        return await self._call(
            functools.partial(
                self._write, functools.partial(_keepalive, lease_id=lease_id, ttl=ttl)
            )
        )

    async def revoke(self, lease_id: int) -> None:
        await self._call(
            functools.partial(self._write, functools.partial(_revoke, lease_id=lease_id))
        )

    # Leases.

    def _reap_if_due(self) -> frozenset[int]:
        """Look for expired leases without locking; only if there is one, take the lock and
        reap. Returns the expired leases left unreaped: reaping is an optimisation, and a
        client that cannot write (read-only, disk full) goes on reading without them."""
        rows = self._conn.execute(
            f"SELECT id FROM leases WHERE {_EXPIRED}", _expired_at(lease_clock())
        ).fetchall()
        if not rows:
            return frozenset()
        if not self.read_only:
            try:
                self._write(_nothing)  # every write transaction reaps first
                return frozenset()
            except sqlite3.Error as exc:
                log.debug("cannot reap expired leases of %s: %s", self.url, exc)
        return frozenset(lease_id for (lease_id,) in rows)

    async def _reap_forever(self) -> None:
        """Reap every `REAP_INTERVAL`. Expired leases that cannot be reaped make no delete
        events: each watch gets a `Resync` instead (once per newly expired lease), which
        leaves their keys out."""
        while not self._closed:
            await asyncio.sleep(REAP_INTERVAL)
            if self._unreachable or self._closed:
                continue
            try:
                unreaped = await self._call(self._reap_if_due)
            except StoreUnavailableError as exc:
                log.debug("lease reaper: %s", exc)
                continue
            if unreaped - self._unreaped:
                self._epoch += 1  # (every watch resyncs, from a read made after this)
                self._wake.set()
            self._unreaped = unreaped

    # Watches.

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[Event]:
        check_prefix(prefix)
        return self.watch_prefixes((prefix,), start_revision)

    async def watch_prefixes(
        self, prefixes: Sequence[str], start_revision: int
    ) -> AsyncGenerator[Event, None]:
        self._check_open()
        distinct = distinct_prefixes(prefixes)
        if self._poller.done():
            raise StoreError(f"store {self.url}: its watch poller has stopped; reopen the store")
        watcher = _Watcher(distinct, start_revision, self._epoch)
        # A revision from before the store followed its path to another file (`_follow_file`)
        # is of another history: the watch starts with a `Resync` of this file.
        watcher.resync = 0 < start_revision <= self._since_floor
        self._watchers.add(watcher)
        self._due += 1
        self._wake.set()
        try:
            while True:
                event = await watcher.queue.get()
                if event is None:
                    return
                if isinstance(event, StoreError):
                    raise event
                yield event
        finally:
            self._watchers.discard(watcher)

    def _poll_read(self, plan: list[tuple[tuple[str, ...], int, bool]]) -> _PollResult:
        """In one read transaction: the revision, the resyncs due, and the new changes (at
        most `POLL_MAX_CHANGES`, from the lowest revision a watch needs: `through` says how
        far they go)."""

        def read(conn: sqlite3.Connection) -> _PollResult:
            now = lease_clock()
            revision, compacted = conn.execute(
                "SELECT revision, compact_revision FROM meta WHERE id = 0"
            ).fetchone()
            resyncs: dict[int, list[KeyValue]] = {}
            low: int | None = None
            for i, (prefixes, next_revision, force) in enumerate(plan):
                if force or next_revision <= compacted:
                    resyncs[i] = _items_under(conn, prefixes, now)
                elif next_revision <= revision:
                    low = next_revision if low is None else min(low, next_revision)
            changes: list[tuple[int, str, bytes | None]] = []
            through = revision
            if low is not None:
                through = min(revision, low + POLL_MAX_CHANGES - 1)
                changes = conn.execute(
                    "SELECT revision, key, value FROM changes"
                    " WHERE revision >= ? AND revision <= ? ORDER BY revision",
                    (low, through),
                ).fetchall()
            return _PollResult(int(revision), int(through), resyncs, changes)

        return self._read(read)

    async def _poll_once(self) -> bool:
        """One poll; True if a watch is left behind the log's end (read a slice only). While
        every watch is served and nothing else is due (`_caught_up`), a poll reads the
        revision only: looking at each of 12,288 idle watches held the loop 20-50 ms."""
        caught_up, self._caught_up = self._caught_up, None
        if caught_up is not None and caught_up[1:] == (self._epoch, self._due):
            revision = await self._call(functools.partial(self._read, _revision))
            if (revision, self._epoch, self._due) == caught_up:
                self._caught_up = caught_up
                return False
        # A watch whose consumer has not read a slice's worth is left out of this poll: it
        # reads on from the log once it has room (the log keeps what it needs for a while).
        epoch, due, everyone = self._epoch, self._due, list(self._watchers)
        watchers: list[_Watcher] = []
        plan: list[tuple[tuple[str, ...], int, bool]] = []
        for start in range(0, len(everyone), POLL_SLICE):
            if start:
                await asyncio.sleep(0)  # (the watches only this poller moves stay as they were)
            for w in everyone[start : start + POLL_SLICE]:
                if w.queue.qsize() < MAX_QUEUED - POLL_MAX_CHANGES:
                    watchers.append(w)
                    plan.append((w.prefixes, w.next_revision, w.resync or w.epoch != epoch))
        if not watchers:
            return False
        skipped = len(watchers) < len(everyone)
        try:
            result = await self._call(functools.partial(self._poll_read, plan))
        except StoreUnavailableError:
            for w in watchers:
                w.resync = True
            raise
        if self._closed or self._unreachable or self._epoch != epoch:
            return False  # cut off while reading: what was read may be stale, resync later
        revision = result.revision
        changes = _Changes(result.changes)
        for i, w in enumerate(watchers):
            if i and i % POLL_SLICE == 0:
                await asyncio.sleep(0)
                if self._closed or self._unreachable or self._epoch != epoch:
                    return False  # (those not handed theirs yet resync, as the others)
            if w not in self._watchers:
                continue
            items = result.resyncs.get(i)
            if items is not None:
                w.queue.put_nowait(Resync(items, revision))
                w.resync = False
                w.epoch = epoch
                w.next_revision = revision + 1
                continue
            for rev, key, value in changes.under(w.prefixes):
                if rev >= w.next_revision:
                    if value is None:
                        w.queue.put_nowait(Delete(key, rev))
                    elif (data := _value(key, value)) is not None:
                        w.queue.put_nowait(Put(key, data, rev))
            w.next_revision = max(w.next_revision, result.through + 1)
            if w.queue.qsize() > MAX_QUEUED:
                log.warning(
                    "watch on %s fell %d events behind; it will resync",
                    ", ".join(w.prefixes),
                    MAX_QUEUED,
                )
                while not w.queue.empty():
                    w.queue.get_nowait()
                w.resync = True
                skipped = True
        behind = result.through < revision
        if not behind and not skipped and (self._epoch, self._due) == (epoch, due):
            self._caught_up = (revision, epoch, due)
        return behind

    async def _poll_forever(self) -> None:
        """Poll until closed. A failed poll is reported (a traceback for the first of a run
        of unexpected failures) and its watches resync on the next one: the poller that
        serves every watch of this instance never stops because of one bad read."""
        failing = lost = False
        while not self._closed:
            behind = False
            if not self._unreachable:
                try:
                    behind = await self._poll_once()
                    failing = False
                    if lost:
                        lost = False
                        self._watch_state(None)
                except StoreUnavailableError as exc:
                    log.debug("watch poll failed: %s", exc)
                    lost = True
                    self._watch_state(exc)
                except Exception:
                    log.log(
                        logging.DEBUG if failing else logging.ERROR,
                        "watch poll of %s failed; watches will resync",
                        self.url,
                        exc_info=True,
                    )
                    failing = True
                    for w in self._watchers:
                        w.resync = True
            if behind:
                continue  # (the next slice at once: reading it yielded to the event loop)
            timeout = POLL_INTERVAL if self._watchers else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()

    def _poller_ended(self, task: asyncio.Task[None]) -> None:
        """If the poller ever stops while the store is open, its watches end with an error
        instead of waiting for events that will never come."""
        if self._closed:
            return
        reason = "cancelled" if task.cancelled() else repr(task.exception())
        log.error("watch poller of %s stopped (%s); ending its watches", self.url, reason)
        for w in self._watchers:
            w.queue.put_nowait(StoreError(f"store {self.url}: watch poller stopped ({reason})"))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_keepalives()
        for task in (self._poller, self._reaper):
            task.cancel()
        await asyncio.gather(self._poller, self._reaper, return_exceptions=True)
        for w in self._watchers:
            w.queue.put_nowait(None)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(sqlite3.Error, RuntimeError):
            await loop.run_in_executor(self._executor, self._conn.close)
        self._executor.shutdown(wait=False)
