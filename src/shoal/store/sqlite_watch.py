"""The watches of the SQLite store: one poller per store instance reads the change log
(`shoal.store.sqlite_log`) and fans what it read out to all of the instance's watches.

Every `POLL_INTERVAL` (50 ms) the poller reads `meta` and, only if some watcher is behind,
the new change rows (`POLL_MAX_CHANGES` at most: a watch further behind gets the next slice
at once), in one read transaction, and fans them out to all of this instance's watches; a
watch whose consumer has a slice's worth unread waits for it to catch up, then reads on
from the log. A watch whose next revision was trimmed, whose read failed, or whose client
was cut off (`set_unreachable`) gets a `Resync` read in that same snapshot. While every
watch is served and none was added, a poll reads the revision alone; otherwise it looks at
its watches `POLL_SLICE` at a time between two yields to the event loop (tens of thousands
of watches: a frontend following thousands of namespaces).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import sqlite3
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from shoal.store.base import (
    MAX_QUEUED_BYTES,
    Delete,
    Event,
    KeyValue,
    Put,
    Resync,
    StoreError,
    StoreUnavailableError,
    WatchQueue,
    check_prefix,
    distinct_prefixes,
)
from shoal.store.sqlite_file import SQLiteFile
from shoal.store.sqlite_kv import _items_under, _revision, _value
from shoal.store.sqlite_leases import lease_clock

log = logging.getLogger("shoal.store.sqlite")  # (the backend's one logger, as it always was)

POLL_INTERVAL = 0.05
"""Seconds between two reads of the change log by an instance's watch poller."""
POLL_MAX_CHANGES = 2048
"""Changes one poll reads at most; a watch further behind is served by the next poll at once
(a slice each: a burst of 30,000 changes is read and fanned out a slice per turn of the
event loop, not in one)."""
POLL_SLICE = 512
"""Watches a poll looks at between two yields to the event loop (24,576 of them, a frontend
swapping 4,096 namespaces, held it up to 1 s per poll)."""
POLL_BYTES = 8 * 1024 * 1024
"""Bytes of keys and values one poll reads at most (past them, the rest is the next poll's):
2,048 changes of values of 1 MiB were 2 GiB in one read."""
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


class SQLiteWatches(SQLiteFile):
    """The watches of one store instance, and the poller that serves them all (see the
    module's docstring); a watch whose instance's poller stops ends with an error."""

    def _start(self) -> None:
        """The watches' state, and the poller that serves them."""
        super()._start()
        self._watchers: set[_Watcher] = set()
        # Bumped when a watch is added (it needs a poll that no new revision brings). With
        # `_caught_up`, (revision, epoch, `_due`) of the last poll that left every watch
        # served and nothing due: the next polls read only the revision until it moves.
        self._due = 0
        self._caught_up: tuple[int, int, int] | None = None
        self._wake = asyncio.Event()
        self._poller = asyncio.create_task(self._poll_forever(), name=f"sqlite-watch {self.path}")
        self._poller.add_done_callback(self._poller_ended)

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
                if (
                    w.queue.qsize() < MAX_QUEUED - POLL_MAX_CHANGES
                    and w.queue.bytes <= MAX_QUEUED_BYTES - POLL_BYTES
                ):
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
            if w.queue.qsize() > MAX_QUEUED or w.queue.bytes > MAX_QUEUED_BYTES:
                log.warning(
                    "watch on %s fell %d events (%d bytes) behind; it will resync",
                    ", ".join(w.prefixes),
                    w.queue.qsize(),
                    w.queue.bytes,
                )
                w.queue.drop()
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
