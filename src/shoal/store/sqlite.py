"""`sqlite:///absolute/path.db`: the embedded store, shared by the processes of one host.

Every process opens the same file; SQLite's WAL mode lets readers run beside the one
writer, and every write is one short `BEGIN IMMEDIATE` transaction.

Layout (`shoal.store.sqlite_layout`): the tables `meta` (the store's revision), `kv` (the
keys), `leases` and `changes` (the change log, `shoal.store.sqlite_log`); a file of an older
layout is migrated at open.

Each write bumps `meta.revision` and appends its change in the same transaction, so
revisions strictly increase across processes and every change is logged exactly once.
Deleting N keys (revoking a lease) takes N revisions, as in the memory backend, and so does
putting N keys with `put_many`: `PUT_MANY_KEYS` per transaction, paced by the file (a
transaction waits while the change log has no room for it without cutting a change younger
than `RETAIN_SECONDS`; see "Compaction"), and leaving the write lock free between two of
them as long as it held it (`PUT_MANY_SHARE`), so other processes' keepalives get in.

Each store instance owns one connection, used only by a dedicated thread; a whole
transaction runs in one hop to that thread (`shoal.store.sqlite_file`, with the URL, and
how an instance follows the file at its path). Background work per instance:

- a watch poller: every `POLL_INTERVAL` (50 ms) it reads `meta` and, only if some watcher
  is behind, the new change rows (`POLL_MAX_CHANGES` at most: a watch further behind gets
  the next slice at once), in one read transaction, and fans them out to all of this
  instance's watches; a watch whose consumer has a slice's worth unread waits for it to
  catch up, then reads on from the log. A watch whose next revision was trimmed, whose
  read failed, or whose client was cut off (`set_unreachable`) gets a `Resync` read in
  that same snapshot.
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

Lease clock (`shoal.store.sqlite_leases`): deadlines are kept on the host's monotonic
clock, with the boot id, so that no step of the wall clock expires every lease at once.

Compaction (`shoal.store.sqlite_log`): the change log keeps every change of the last
`RETAIN_SECONDS` (5 s) and the last `RETAIN_CHANGES` (1,000) revisions however old, within
hard caps of `MAX_LOG_CHANGES` (100,000) rows and `MAX_LOG_BYTES` (64 MiB), trimmed every
`TRIM_EVERY` revisions, so its size is bounded whatever the write rate, and writers in
several processes at once (workers re-putting their cards after losing their leases
together) do not write it through before another process's watch reads it. A watcher that
falls behind what it keeps gets a `Resync`, and a listing of what changed since a revision
the log still reaches, `DELTA_CHANGES` back at most, is read from it (`sqlite_kv._changes_since`:
a delta, the keys the log names,
whatever the number of keys unchanged; a reconciliation pass over a quiet fleet of 100,000
reads nothing per instance). The WAL is checkpointed automatically
every `WAL_AUTOCHECKPOINT_PAGES` pages and truncated to `JOURNAL_SIZE_LIMIT` afterwards.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import sqlite3
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from shoal.store.base import (
    MAX_QUEUED_BYTES,
    Delete,
    Event,
    KeyValue,
    LeaseNotFoundError,
    Listing,
    Put,
    Resync,
    Snapshot,
    StoreError,
    StoreUnavailableError,
    WatchQueue,
    check_key,
    check_prefix,
    check_value,
    checked_items,
    checked_keys,
    distinct_prefixes,
)
from shoal.store.sqlite_file import SQLiteFile
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
    _value,
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
POLL_BYTES = 8 * 1024 * 1024
"""Bytes of keys and values one poll reads at most (past them, the rest is the next poll's):
2,048 changes of values of 1 MiB were 2 GiB in one read."""
PUT_MANY_SHARE = 0.5
"""The share of the time a `put_many` holds the file's write lock at most: after each of its
transactions it leaves the lock free as long as it held it, so other processes' keepalives
and writes get in between (SQLite's busy handler retries by sleeping, and misses a gap that
is only a turn of the event loop)."""
MAX_QUEUED = 10_000
"""Events queued for a watch that is not being read before it is dropped for a `Resync`;
likewise past `MAX_QUEUED_BYTES` of their keys and values. A watch with a poll's worth of
either unread is not polled until its consumer catches up (`_poll_once`), so neither is
reached while the log holds what the watch needs."""


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
    queue: WatchQueue[Event | StoreError | None] = field(default_factory=WatchQueue)
    resync: bool = False


class SQLiteStore(SQLiteFile):
    """The store in one SQLite file shared by the processes of a host. Open with `open`."""

    def __init__(
        self,
        url: str,
        path: Path,
        conn: sqlite3.Connection,
        executor: ThreadPoolExecutor,
        read_only: bool = False,
    ) -> None:
        super().__init__(url, path, conn, executor, read_only)
        # Expired leases this instance found and could not reap (see `_reap_forever`).
        self._unreaped: frozenset[int] = frozenset()
        self._watchers: set[_Watcher] = set()
        self._wake = asyncio.Event()
        self._poller = asyncio.create_task(self._poll_forever(), name=f"sqlite-watch {path}")
        self._poller.add_done_callback(self._poller_ended)
        self._reaper = asyncio.create_task(self._reap_forever(), name=f"sqlite-reaper {path}")

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
                for w in self._watchers:
                    w.resync = True
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
        most `POLL_MAX_CHANGES` and `POLL_BYTES`, from the lowest revision a watch needs:
        `through` says how far they go)."""

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
                rows = conn.execute(
                    "SELECT revision, key, value FROM changes"
                    " WHERE revision >= ? AND revision <= ? ORDER BY revision",
                    (low, through),
                )
                size = 0
                with contextlib.closing(rows):
                    for row in rows:
                        value = row[2]
                        size += len(row[1]) + (len(value) if isinstance(value, bytes) else 0)
                        if size > POLL_BYTES and changes:
                            through = row[0] - 1  # (this one is the next poll's)
                            break
                        changes.append(row)
            return _PollResult(int(revision), int(through), resyncs, changes)

        return self._read(read)

    async def _poll_once(self) -> bool:
        """One poll; True if a watch is left behind the log's end (read a slice only)."""
        # A watch whose consumer has not read a slice's worth is left out of this poll: it
        # reads on from the log once it has room (the log keeps what it needs for a while).
        watchers = [
            w
            for w in self._watchers
            if w.queue.qsize() < MAX_QUEUED - POLL_MAX_CHANGES
            and w.queue.bytes <= MAX_QUEUED_BYTES - POLL_BYTES
        ]
        if not watchers:
            return False
        epoch = self._epoch
        plan = [(w.prefixes, w.next_revision, w.resync or w.epoch != epoch) for w in watchers]
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
            if w.queue.qsize() > MAX_QUEUED or w.queue.bytes > MAX_QUEUED_BYTES:
                log.warning(
                    "watch on %s fell %d events (%d bytes) behind; it will resync",
                    ", ".join(w.prefixes),
                    w.queue.qsize(),
                    w.queue.bytes,
                )
                w.queue.drop()
                w.resync = True
        return result.through < revision

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
