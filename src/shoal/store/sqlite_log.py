"""The change log of the SQLite store (`changes`): what it keeps, for how long, and how a
`put_many` waits for room in it. Statements here run inside a transaction, in the store
thread (see `shoal.store.sqlite`).

Watches read the log every `POLL_INTERVAL`; a watch whose next revision was trimmed gets a
`Resync` of its whole prefix. The log keeps:

- every change written in the last `RETAIN_SECONDS` (5 s: a hundred polls), whatever the
  number of writers and processes, so a watch that polls on time, even under a load that
  delays it by seconds, reads each change as its own event;
- and the last `RETAIN_CHANGES` (1,000) revisions however old, so a quiet fleet's listing
  of what changed since a recent revision is a delta read from the log;
- within two hard caps, `MAX_LOG_CHANGES` (100,000 rows) and `MAX_LOG_BYTES` (64 MiB of keys
  and values): past them the oldest changes go, young or not, and the file stays bounded
  whatever is written.

Changes that come of age go `TRIM_OLD` per trim at most, so no write pays for deleting a
whole burst at once.

Each change row records when it was written (`at`, on the lease clock: the monotonic clock
every process of the host shares, read under the write lock, so `at` never decreases with
the revision; a row from another boot, ahead of this clock, counts as old). The bytes the
log holds are counted in `meta.log_bytes` by two triggers, so every process keeps the count
right, an older version's too.

A `put_many` is paced by the file, not by the call: before each of its transactions it
checks that the caps have room for it without cutting a change younger than
`RETAIN_SECONDS`, else waits (outside the lock) until the oldest comes of age. So a burst of
up to `MAX_LOG_CHANGES` keys (three workers re-putting 10,000 cards each) goes at full
speed, and beyond that all writers together write no faster than the log can keep. Single
writes (a put, a delete, a lease revoked with its keys) are not paced: past the caps they
trim young changes, and the watches that missed them resync (correct, only slower).

Files written by an older version get the column and the triggers at open (`LOG_LAYOUT`);
until every process runs this version, an older one trims the log to its last 1,000
revisions as it always did.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from typing import TypeVar

V = TypeVar("V", bytes, bytes | None)

RETAIN_CHANGES = 1000
"""Revisions the log keeps however old (within the caps): a listing of what changed since a
recent revision is read from the log."""
RETAIN_SECONDS = 5.0
"""Seconds the log keeps each change (within the caps); a `put_many` waits rather than cut one
younger."""
MAX_LOG_CHANGES = 100_000
"""Rows the log holds at most, give or take the `TRIM_EVERY` written between two trims (a
hard cap): its oldest go first."""
MAX_LOG_BYTES = 64 * 1024 * 1024
"""Bytes of keys and values the log holds at most, give or take what is written between two
trims (a hard cap): its oldest go first."""
TRIM_EVERY = 64
"""The log is trimmed on every `TRIM_EVERY`-th revision."""
TRIM_OLD = 4096
"""Changes one trim deletes at most for their age (about 20 ms of the write lock, the two
triggers included): after a burst of 100,000 they go over the next writes, not in one
transaction of half a second that every other process's writes wait for. The caps are
kept whatever this deletes."""
PUT_MANY_KEYS = 250
"""Keys a `put_many` writes per transaction (a few milliseconds of the store thread)."""
PUT_MANY_BYTES = 4 * 1024 * 1024
"""Bytes of keys and values a `put_many` writes per transaction at most (one key more only if
it is alone): a transaction of large values holds the lock no longer, and always fits the log."""

_BYTES = "length(key) + coalesce(length(value), 0)"
"""SQL, on `changes`: the bytes of a change (SQLite reads a BLOB's length from the row's
header, not its content)."""
LOG_TRIGGERS = (
    "CREATE TRIGGER IF NOT EXISTS changes_counted AFTER INSERT ON changes BEGIN"
    " UPDATE meta SET log_bytes = log_bytes + length(NEW.key) + coalesce(length(NEW.value), 0)"
    " WHERE id = 0; END",
    "CREATE TRIGGER IF NOT EXISTS changes_uncounted AFTER DELETE ON changes BEGIN"
    " UPDATE meta SET log_bytes = log_bytes - length(OLD.key) - coalesce(length(OLD.value), 0)"
    " WHERE id = 0; END",
)
"""Keep `meta.log_bytes` the bytes of the log, whichever process writes or trims it."""
LOG_LAYOUT = {
    "changes.at": "ALTER TABLE changes ADD COLUMN at REAL NOT NULL DEFAULT 0",
    "meta.log_bytes": "ALTER TABLE meta ADD COLUMN log_bytes INTEGER NOT NULL DEFAULT 0",
}
"""What the log's retention adds to a file of the version-2 layout, at open where missing (a
process of an older version writes rows without `at`: they count as old)."""


def add_log_layout(conn: sqlite3.Connection, have: set[str]) -> None:
    """Give a file the columns and triggers of the log's retention where it lacks them
    (`have`: its `table.column`s), counting what its log holds once."""
    for column, statement in LOG_LAYOUT.items():
        if column not in have:
            conn.execute(statement)
    triggers = {
        name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")
    }
    if not {"changes_counted", "changes_uncounted"} <= triggers:
        for statement in LOG_TRIGGERS:
            conn.execute(statement)
        conn.execute(
            f"UPDATE meta SET log_bytes = (SELECT coalesce(sum({_BYTES}), 0) FROM changes)"
        )


def append(conn: sqlite3.Connection, now: float, key: str, value: bytes | None) -> int:
    """Take the next revision and log the change (`None`: a delete); trim now and then."""
    conn.execute("UPDATE meta SET revision = revision + 1 WHERE id = 0")
    (revision,) = conn.execute("SELECT revision FROM meta WHERE id = 0").fetchone()
    conn.execute(
        "INSERT INTO changes (revision, key, value, at) VALUES (?, ?, ?, ?)",
        (revision, key, value, now),
    )
    if revision % TRIM_EVERY == 0:
        trim(conn, revision, now)
    return int(revision)


def append_many(
    conn: sqlite3.Connection, now: float, first: int, items: Sequence[tuple[str, V]]
) -> list[tuple[int, str, V]]:
    """Log `items` at revisions from `first` (taken by the caller), one row each (a value of
    `None`: a delete); trim as `append` would have. Returns each change with its revision."""
    last = first + len(items) - 1
    conn.execute("UPDATE meta SET revision = ? WHERE id = 0", (last,))
    logged = [(first + i, key, value) for i, (key, value) in enumerate(items)]
    conn.executemany(
        "INSERT INTO changes (revision, key, value, at) VALUES (?, ?, ?, ?)",
        [(revision, key, value, now) for revision, key, value in logged],
    )
    if last // TRIM_EVERY > (first - 1) // TRIM_EVERY:
        trim(conn, last, now)
    return logged


def trim(conn: sqlite3.Connection, revision: int, now: float) -> None:
    """Trim the log to what it keeps at `revision` (see the module's docstring): changes older
    than `RETAIN_SECONDS` beyond the last `RETAIN_CHANGES` (`TRIM_OLD` at most), then the
    oldest past the caps. Reads the rows it deletes and one more, never the log's length."""
    (compacted,) = conn.execute("SELECT compact_revision FROM meta WHERE id = 0").fetchone()
    cut = compacted
    floor = min(revision - RETAIN_CHANGES, compacted + TRIM_OLD)
    if floor > cut:
        # `at` never decreases with the revision: the old ones are a run from the start.
        young = conn.execute(
            "SELECT revision FROM changes WHERE revision > ? AND revision <= ?"
            " AND at >= ? AND at <= ? ORDER BY revision LIMIT 1",
            (cut, floor, now - RETAIN_SECONDS, now),
        ).fetchone()
        cut = floor if young is None else young[0] - 1
    cut = max(cut, revision - MAX_LOG_CHANGES)
    if cut > compacted:
        conn.execute("DELETE FROM changes WHERE revision <= ?", (cut,))
    (held,) = conn.execute("SELECT log_bytes FROM meta WHERE id = 0").fetchone()
    if held > MAX_LOG_BYTES:
        cut = max(cut, _cut_for_bytes(conn, cut, held - MAX_LOG_BYTES))
        conn.execute("DELETE FROM changes WHERE revision <= ?", (cut,))
    if cut > compacted:
        conn.execute(
            "UPDATE meta SET compact_revision = ? WHERE id = 0 AND compact_revision < ?",
            (cut, cut),
        )


def _cut_for_bytes(conn: sqlite3.Connection, after: int, excess: int) -> int:
    """The revision up to which the oldest changes after `after` hold `excess` bytes (the
    last change, if all of them hold fewer)."""
    rows = conn.execute(
        f"SELECT revision, {_BYTES} FROM changes WHERE revision > ? ORDER BY revision", (after,)
    )
    cut = after
    for revision, size in rows:
        cut = revision
        excess -= size
        if excess <= 0:
            break
    return int(cut)


def wait_for_room(conn: sqlite3.Connection, now: float, count: int, size: int) -> float:
    """Seconds until `count` changes of `size` bytes fit the log without the caps cutting a
    change younger than `RETAIN_SECONDS`; 0 if they fit now. Never more than
    `RETAIN_SECONDS`: the change the caps would cut comes of age by then."""
    revision, compacted, held = conn.execute(
        "SELECT revision, compact_revision, log_bytes FROM meta WHERE id = 0"
    ).fetchone()
    over_rows = revision - compacted + count - MAX_LOG_CHANGES
    over_bytes = held + size - MAX_LOG_BYTES
    if over_rows <= 0 and over_bytes <= 0:
        return 0.0
    # The newest change the caps would cut (the log may have a gap an older version
    # trimmed: the first row from there). Found by bytes, the rows read are those cut.
    cut = compacted + max(1, over_rows)
    if over_bytes > 0:
        cut = max(cut, _cut_for_bytes(conn, compacted, over_bytes))
    row = conn.execute(
        "SELECT at FROM changes WHERE revision >= ? ORDER BY revision LIMIT 1", (cut,)
    ).fetchone()
    if row is None or not now - RETAIN_SECONDS <= row[0] <= now:
        return 0.0
    return float(row[0] + RETAIN_SECONDS - now)


def batches(items: Sequence[tuple[str, bytes]]) -> Iterator[Sequence[tuple[str, bytes]]]:
    """`items` in slices of at most `PUT_MANY_KEYS` keys and `PUT_MANY_BYTES` bytes (a key
    larger than that alone)."""
    start = 0
    while start < len(items):
        end, size = start, 0
        while end < len(items) and end - start < PUT_MANY_KEYS:
            key, value = items[end]
            size += len(key) + len(value)
            if size > PUT_MANY_BYTES and end > start:
                break
            end += 1
        yield items[start:end]
        start = end
