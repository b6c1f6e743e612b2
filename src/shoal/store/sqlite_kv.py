"""The statements on the SQLite store's keys (`kv`), each run inside a transaction in the
store thread (see `shoal.store.sqlite`): the listings (every key under a prefix, what
changed since a revision, and the delta the change log gives, `_changes_since`), and the
writes, each a change of its own in the change log (`shoal.store.sqlite_log`), the end of
a lease included: revoked or reaped, it deletes its keys, one revision each.

A read never returns a key whose lease has expired, reaped or not (`sqlite_leases._LIVE`).
A value that is not a BLOB (only a hand edit of the file makes one) is reported and skipped.
"""

from __future__ import annotations

import itertools
import logging
import operator
import sqlite3
from collections.abc import Iterator, Sequence
from itertools import compress

from shoal.store.base import KeyRevision, KeyValue, Listing
from shoal.store.sqlite_layout import LISTING_INDEX
from shoal.store.sqlite_leases import _EXPIRED, _LIVE, _expired_at, _lease_exists
from shoal.store.sqlite_log import (
    RETAIN_CHANGES,
    TRIM_EVERY,
    append,
    append_many,
    wait_for_room,
)

log = logging.getLogger("shoal.store.sqlite")  # (the backend's one logger, as it always was)

DELTA_CHANGES = RETAIN_CHANGES + TRIM_EVERY
"""Revisions back a listing of what changed is read from the change log at most, as a delta
(`_changes_since`): it scans them once per prefix. The log may keep up to `MAX_LOG_CHANGES`
(every change of the last `RETAIN_SECONDS`); further back, the listing is whole."""


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
    if not keys:
        return
    # the keys deleted in two statements and logged by one `executemany`, each at a revision
    # of its own in key order, as one by one (20,000 keys held the write lock 0.4 s)
    conn.execute("DELETE FROM kv WHERE lease = ?", (lease_id,))
    append_many(conn, now, _revision(conn) + 1, [(key, None) for (key,) in keys])


def _reap(conn: sqlite3.Connection, now: float) -> None:
    expired = conn.execute(f"SELECT id FROM leases WHERE {_EXPIRED}", _expired_at(now)).fetchall()
    for (lease_id,) in expired:
        log.debug("lease %x expired", lease_id)
        _end_lease(conn, now, lease_id)


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


def _revoke(conn: sqlite3.Connection, now: float, lease_id: int) -> None:
    _end_lease(conn, now, lease_id)


def _nothing(conn: sqlite3.Connection, now: float) -> None:
    return None
