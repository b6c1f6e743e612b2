"""`sqlite:///absolute/path.db`: the embedded store, shared by the processes of one host.

Every process opens the same file; SQLite's WAL mode lets readers run beside the one
writer, and every write is one short `BEGIN IMMEDIATE` transaction.

The backend in its parts, each with its own docstring: `sqlite_file` (the URL, opening the
file, the one connection to it and following the file at its path), `sqlite_layout` (the
tables `meta`, `kv`, `leases` and `changes`, and migrating older files), `sqlite_leases`
(the lease clock), `sqlite_kv` (the statements on keys), `sqlite_log` (the change log) and
`sqlite_watch` (the watches and their poller). `SQLiteStore`, here, puts them together:
its reads, writes and leases, and its lease reaper.

Each write bumps `meta.revision` and appends its change in the same transaction, so
revisions strictly increase across processes and every change is logged exactly once.
Deleting N keys (revoking a lease) takes N revisions, as in the memory backend, and so does
putting N keys with `put_many`: `PUT_MANY_KEYS` per transaction, paced by the file (a
transaction waits while the change log has no room for it without cutting a change younger
than `RETAIN_SECONDS`; see "Compaction"), and leaving the write lock free between two of
them as long as it held it (`PUT_MANY_SHARE`), so other processes' keepalives get in.

Each store instance owns one connection, used only by a dedicated thread; a whole
transaction runs in one hop to that thread. Background work per instance:

- a watch poller (`sqlite_watch`): every `POLL_INTERVAL` (50 ms) it reads what is new in
  the change log and fans it out to all of this instance's watches; a watch whose next
  revision was trimmed gets a `Resync`.
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

Lease deadlines are kept on the host's monotonic clock, with the boot id, so that no step
of the wall clock expires every lease at once ("Lease clock" in `sqlite_leases`).

Compaction (`shoal.store.sqlite_log`): the change log keeps every change of the last
`RETAIN_SECONDS` (5 s) and the last `RETAIN_CHANGES` (1,000) revisions however old, within
hard caps of `MAX_LOG_CHANGES` (100,000) rows and `MAX_LOG_BYTES` (64 MiB), trimmed every
`TRIM_EVERY` revisions, so its size is bounded whatever the write rate, and writers in
several processes at once (workers re-putting their cards after losing their leases
together) do not write it through before another process's watch reads it. A watcher that
falls behind what it keeps gets a `Resync`, and a listing of what changed since a revision
the log still reaches, `DELTA_CHANGES` back at most, is read from it
(`sqlite_kv._changes_since`: a delta, the keys the log names, whatever the number of keys
unchanged; a reconciliation pass over a quiet fleet of 100,000 reads nothing per
instance). The WAL is checkpointed automatically every `WAL_AUTOCHECKPOINT_PAGES` pages and
truncated to `JOURNAL_SIZE_LIMIT` afterwards (`sqlite_file`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from shoal.store.base import (
    KeyValue,
    LeaseNotFoundError,
    Listing,
    Snapshot,
    StoreError,
    StoreUnavailableError,
    check_key,
    check_prefix,
    check_value,
    checked_items,
    checked_keys,
    distinct_prefixes,
)
from shoal.store.sqlite_kv import (
    _KV_COLUMNS,
    _changed_items,
    _changes_since,
    _create,
    _delete,
    _delete_many,
    _has_listing_index,
    _items_under,
    _kv,
    _nothing,
    _put,
    _put_many,
    _reap,
    _revision,
    _revoke,
)
from shoal.store.sqlite_kv import BUILD_SLICE as BUILD_SLICE  # (re-exported)
from shoal.store.sqlite_kv import DELTA_CHANGES as DELTA_CHANGES  # (re-exported)
from shoal.store.sqlite_layout import LISTING_INDEX as LISTING_INDEX  # (re-exported)
from shoal.store.sqlite_leases import (
    _EXPIRED,
    _LIVE,
    _expired_at,
    _grant,
    _keepalive,
    lease_clock,
)
from shoal.store.sqlite_leases import BOOT_ID as BOOT_ID  # (re-exported)
from shoal.store.sqlite_log import RETAIN_SECONDS, batches
from shoal.store.sqlite_watch import POLL_INTERVAL, SQLiteWatches

log = logging.getLogger(__name__)

T = TypeVar("T")

REAP_INTERVAL = 0.2
"""Seconds between two looks for expired leases."""
PUT_MANY_SHARE = 0.5
"""The share of the time a `put_many` holds the file's write lock at most: after each of its
transactions it leaves the lock free as long as it held it, so other processes' keepalives
and writes get in between (SQLite's busy handler retries by sleeping, and misses a gap that
is only a turn of the event loop)."""


class SQLiteStore(SQLiteWatches):
    """The store in one SQLite file shared by the processes of a host. Open with `open`."""

    def _start(self) -> None:
        """The lease reaper, started after the watch poller."""
        super()._start()
        # Expired leases this instance found and could not reap (see `_reap_forever`).
        self._unreaped: frozenset[int] = frozenset()
        self._reaper = asyncio.create_task(self._reap_forever(), name=f"sqlite-reaper {self.path}")

    # Plumbing.

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
