"""`memory://[name]`: an in-process store, for unit tests and single-process setups.

Stores opened with the same name in one process share their data. It keeps the full
contract (revisions, leases that expire, gap-free watches) but nothing survives the process.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from shoal.store.base import (
    MAX_QUEUED_BYTES,
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
    StoreUnavailableError,
    WatchQueue,
    change_bytes,
    check_key,
    check_prefix,
    check_value,
    checked_items,
    checked_keys,
    distinct_prefixes,
)

HISTORY = 100_000
HISTORY_BYTES = 64 * 1024 * 1024
"""Bytes of keys and values the history (for watches from a past revision) holds at most, its
oldest changes dropped first: 100,000 changes of values of 1 MiB were 100 GiB. A watch from
before the oldest change left gets a `Resync`."""
MAX_QUEUED = 10_000
"""Events queued for a watch that is not being read before they are dropped for a `Resync`;
likewise past `MAX_QUEUED_BYTES` of their keys and values."""
PUT_MANY_KEYS = 1024
"""Keys a `put_many` writes in one step, between two yields to the event loop. Nothing waits
for the watches of the process: one whose reader takes fewer events than this per turn
falls behind a long `put_many` and, past `MAX_QUEUED` events queued, gets a `Resync` (its
prefix whole, as after any gap) instead of a `Put` per key. A discovery consumer taking 64
events a turn got one `Resync` of 11,265 keys while 20,000 cards were put in batches of
1,024. memory:// is for tests and one process: that costs a listing, not a change missed."""

_RESYNC = object()  # queued for a watch that must resync (its client was cut off, or lagged)
_CLOSED = object()  # queued for a watch whose store was closed: the watch ends


@dataclass
class _Data:
    items: dict[str, KeyValue] = field(default_factory=dict)
    revision: int = 0
    leases: dict[int, float] = field(default_factory=dict)  # id -> deadline (monotonic)
    lease_keys: dict[int, set[str]] = field(default_factory=dict)
    history: deque[Put | Delete] = field(default_factory=deque)
    history_bytes: int = 0
    watchers: set[tuple[tuple[str, ...], WatchQueue[Put | Delete | object], MemoryStore]] = field(
        default_factory=set
    )
    lease_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(0x1000))


_shared: dict[str, _Data] = {}


class MemoryStore(Store):
    def __init__(self, url: str = "memory://") -> None:
        super().__init__()
        self.url = url
        name = url.partition("://")[2]
        self._d = _shared.setdefault(name, _Data()) if name else _Data()
        self._closed = False
        self._unreachable = False
        self._reaper: asyncio.Task[None] | None = None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError(f"store {self.url} is closed")
        if self._unreachable:
            raise StoreUnavailableError(f"store {self.url} is unreachable")

    def set_unreachable(self, unreachable: bool) -> None:
        """Test seam (see `Store.set_unreachable`): this client loses (or regains) its store.

        While cut off, its calls fail and its watches miss events; when it comes back, each
        of its watches yields a `Resync`, as after a dropped connection.
        """
        self._unreachable = unreachable
        if not unreachable:
            for _, queue, owner in self._d.watchers:
                if owner is self:
                    queue.put_nowait(_RESYNC)
        self._watch_state(
            StoreUnavailableError(f"store {self.url} is unreachable") if unreachable else None
        )

    def _emit(self, event: Put | Delete) -> None:
        size = change_bytes(event)
        history = self._d.history
        history.append(event)
        self._d.history_bytes += size
        while len(history) > HISTORY or self._d.history_bytes > HISTORY_BYTES:
            self._d.history_bytes -= change_bytes(history.popleft())
        for prefixes, queue, owner in self._d.watchers:
            if event.key.startswith(prefixes) and not owner._unreachable:
                if queue.qsize() >= MAX_QUEUED or queue.bytes + size > MAX_QUEUED_BYTES:
                    queue.drop()  # not read: drop its backlog for a Resync
                    queue.put_nowait(_RESYNC)
                else:
                    queue.put_nowait(event)

    def _delete_now(self, key: str) -> bool:
        kv = self._d.items.pop(key, None)
        if kv is None:
            return False
        if kv.lease:
            self._d.lease_keys.get(kv.lease, set()).discard(key)
        self._d.revision += 1
        self._emit(Delete(key, self._d.revision))
        return True

    def _reap(self) -> None:
        now = time.monotonic()
        for lease_id, deadline in list(self._d.leases.items()):
            if deadline < now:
                self._end_lease(lease_id)

    def _end_lease(self, lease_id: int) -> None:
        self._d.leases.pop(lease_id, None)
        for key in sorted(self._d.lease_keys.pop(lease_id, set())):
            self._delete_now(key)

    async def _reap_forever(self) -> None:
        while not self._closed:
            self._reap()
            await asyncio.sleep(0.05)

    async def get_prefix(self, prefix: str) -> Snapshot:
        check_prefix(prefix)
        return await self.get_prefixes((prefix,))

    async def get_prefixes(
        self, prefixes: Sequence[str], *, on_answer: Callable[[], None] | None = None
    ) -> Snapshot:
        self._check_open()
        self._reap()
        snap = Snapshot(self._items(distinct_prefixes(prefixes)), self._d.revision)
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
        snap = await self.get_prefixes(prefixes, on_answer=on_answer)
        items: list[KeyValue | KeyRevision] = [
            kv
            if kv.mod_revision > since
            else KeyRevision(kv.key, kv.mod_revision, kv.lease, kv.create_revision)
            for kv in snap.items
        ]
        return Listing(items, snap.revision)

    def _items(self, prefixes: tuple[str, ...]) -> list[KeyValue]:
        items = (kv for k, kv in self._d.items.items() if k.startswith(prefixes))
        return sorted(items, key=lambda kv: kv.key)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        self._check_open()
        check_key(key)
        check_value(key, value)
        self._reap()
        if lease and lease not in self._d.leases:
            raise LeaseNotFoundError(f"lease {lease:x} does not exist (put {key!r})")
        return self._put_now(key, bytes(value), lease)

    async def put_many(self, items: Sequence[tuple[str, bytes]], *, lease: int = 0) -> int:
        """Each key at a revision of its own, `PUT_MANY_KEYS` keys per step (with no await
        between: one transaction), yielding to the event loop between steps. A watch whose
        reader falls behind gets a `Resync` once `MAX_QUEUED` events wait for it (see
        `PUT_MANY_KEYS`)."""
        self._check_open()
        checked = await checked_items(items)
        self._check_open()  # (closed while the items were checked)
        revision = 0
        for start in range(0, len(checked), PUT_MANY_KEYS):
            if start:
                await asyncio.sleep(0)
                self._check_open()
            self._reap()
            if lease and lease not in self._d.leases:
                raise LeaseNotFoundError(f"lease {lease:x} does not exist (put_many)")
            for key, value in checked[start : start + PUT_MANY_KEYS]:
                revision = self._put_now(key, value, lease)
        return revision

    def _put_now(self, key: str, value: bytes, lease: int) -> int:
        old = self._d.items.get(key)
        if old is not None and old.lease and old.lease != lease:
            self._d.lease_keys.get(old.lease, set()).discard(key)
        self._d.revision += 1
        created = self._d.revision if old is None else old.create_revision
        self._d.items[key] = KeyValue(key, value, self._d.revision, lease, created)
        if lease:
            self._d.lease_keys.setdefault(lease, set()).add(key)
        self._emit(Put(key, value, self._d.revision))
        return self._d.revision

    async def create(self, key: str, value: bytes, *, lease: int = 0) -> bool:
        self._check_open()
        check_key(key)
        check_value(key, value)
        self._reap()
        if key in self._d.items:
            return False
        await self.put(key, value, lease=lease)
        return True

    async def delete(self, key: str) -> bool:
        self._check_open()
        check_key(key)
        return self._delete_now(key)

    async def delete_many(self, keys: Sequence[str]) -> int:
        """`PUT_MANY_KEYS` keys per step, yielding to the event loop between steps."""
        self._check_open()
        checked = await checked_keys(keys)
        deleted = 0
        for start in range(0, len(checked), PUT_MANY_KEYS):
            if start:
                await asyncio.sleep(0)
            self._check_open()
            deleted += sum(map(self._delete_now, checked[start : start + PUT_MANY_KEYS]))
        return deleted

    async def _grant(self, ttl: float) -> int:
        self._check_open()
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="memory-store-reaper")
        lease_id = next(self._d.lease_ids)
        self._d.leases[lease_id] = time.monotonic() + ttl
        return lease_id

    async def _keepalive(self, lease_id: int, ttl: float) -> bool:
        self._check_open()
        self._reap()
        if lease_id not in self._d.leases:
            return False
        self._d.leases[lease_id] = time.monotonic() + ttl
        return True

    async def revoke(self, lease_id: int) -> None:
        self._check_open()
        self._end_lease(lease_id)

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[Event]:
        check_prefix(prefix)
        return self.watch_prefixes((prefix,), start_revision)

    async def watch_prefixes(
        self, prefixes: Sequence[str], start_revision: int
    ) -> AsyncGenerator[Event, None]:
        self._check_open()
        prefixes = distinct_prefixes(prefixes)
        queue: WatchQueue[Put | Delete | object] = WatchQueue()
        entry = (prefixes, queue, self)
        # Replay and subscribe with no await between: nothing can slip through.
        oldest = self._d.history[0].revision if self._d.history else self._d.revision + 1
        backlog: list[Event]
        if start_revision < oldest and start_revision <= self._d.revision:
            backlog = [self._resync(prefixes)]
        else:
            backlog = [
                e
                for e in self._d.history
                if e.revision >= start_revision and e.key.startswith(prefixes)
            ]
        self._d.watchers.add(entry)
        seen = 0  # the revision of the last Resync: nothing at or below it may follow
        try:
            for event in backlog:
                seen = event.revision if isinstance(event, Resync) else seen
                yield event
            while not self._closed:
                change = await queue.get()
                if change is _CLOSED:
                    return
                if change is _RESYNC:
                    resync = self._resync(prefixes)
                    seen = resync.revision
                    yield resync
                elif isinstance(change, Put | Delete) and change.revision > seen:
                    yield change
        finally:
            self._d.watchers.discard(entry)

    def _resync(self, prefixes: tuple[str, ...]) -> Resync:
        return Resync(self._items(prefixes), self._d.revision)

    async def close(self) -> None:
        self._closed = True
        self._stop_keepalives()
        for _, queue, owner in list(self._d.watchers):
            if owner is self:
                queue.put_nowait(_CLOSED)
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
