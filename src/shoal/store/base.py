"""The store contract: a revisioned key-value store with leases and gap-free prefix watches.

Every backend (memory, SQLite, etcd) implements `Store`. The invariants, which the contract
suite in `tests/store/` proves on each backend:

- Every read returns the revision it saw; a watch started at `revision + 1` delivers every
  later change exactly once, so list-then-watch has no gap.
- After the backend connection drops and returns, a watch yields a `Resync` carrying the
  full current state of its prefix, so deletes made meanwhile are never lost.
- Each key carries the revision that created it (`create_revision`): a delete followed by a
  create at the same key gives a new one, so a reader that missed the delete (a `Resync`, a
  later listing) still tells a new key from a modified one.
- Keys put under a lease vanish, with delete events, when the lease expires or is revoked.
  A key whose lease has expired is never returned by a read or a listing, by any client,
  even one that just opened the store; watchers get its delete within TTL + 1 s. (etcd
  counts TTLs in whole seconds, at least its minimum: a shorter lease of a holder that
  died lasts that long there; see `shoal.store.etcd`.)
- `close()` ends every watch of the instance (its iterator stops) and stops the keepalive
  of every lease it granted; leases themselves are not revoked.
- A watch does not raise when the store goes out: it catches up on its own once it is
  back. It tells the instance's `watch_listeners` instead: each is called with the error
  when a watch loses the store (at each failed attempt to get it back), and with None
  when a watch that lost it has it back, so a reader reports the store's state as its
  watch sees it, not at its next read.
- A watch yields nothing at or below the revision of a `Resync` it has yielded.
- Several prefixes read or watched as one (`get_prefixes`, `watch_prefixes`) share one
  revision: a listing reads them all at one revision, a watch delivers the changes under
  any of them in revision order, and its `Resync` carries all of them at one revision. A
  reader joining keys of two prefixes (discovery: instances and cards) never holds one
  prefix's state from a later revision than the other's.
- A listing of what changed since a revision (`get_prefixes_changed(prefixes, since)`)
  lists every key `get_prefixes` would, at one revision, with the same revisions and
  lease; only a key whose `mod_revision <= since` may come without its value (a
  `KeyRevision`). A key is written at most once per revision, so a reader that holds a
  key's value read at exactly that `mod_revision` holds the value the listing left out; any other
  reader must read it (a backend may send every value: a `KeyValue` is always correct).
  A backend whose change log covers `since` may answer with a delta instead (`Listing.
  removed`): only the keys written since, and the keys gone since. What a reader holds at
  `since` plus the delta is what a whole listing would have given.
- `put_many` writes many keys in few transactions (a worker putting back 20,000 cards
  after a lost lease), and each is still a change of its own: a watch gets one `Put` per
  key (one whose reader falls too far behind gets a `Resync`, as after any gap). Keys
  written by one transaction may share its revision (etcd's), so a consumer tells changes
  apart by key and revision, never by revision alone.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

log = logging.getLogger(__name__)

MAX_VALUE_BYTES = 1024 * 1024
MAX_KEY_BYTES = 1024
MAX_QUEUED_BYTES = 64 * 1024 * 1024
"""Bytes of keys and values queued for one watch whose consumer does not read, at most: past
them it is treated as past its count of events (each backend's `MAX_QUEUED`, 10,000), which
alone let a watch hold 10,000 values of `MAX_VALUE_BYTES`, 10 GiB. 64 MiB is 64 values of
the largest size, several thousand cards of a few KiB (the count still governs those), and
what SQLite's change log holds at most (`sqlite_log.MAX_LOG_BYTES`)."""
_KEY_RE = re.compile(r"^[A-Za-z0-9._\-/:@+=]+$")
CHECK_SLICE = 1024
"""Items `put_many` checks between two yields to the event loop (about 1-3 ms of it)."""


class StoreError(Exception):
    """Base class for store failures."""


class InvalidKeyError(StoreError, ValueError):
    """A key that the store refuses: empty, too long or with forbidden characters."""


class ValueTooLargeError(StoreError, ValueError):
    """A value over `MAX_VALUE_BYTES`."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The backend could not be reached (at start, or for longer than a call allows)."""


class LeaseNotFoundError(StoreError):
    """The lease does not exist: it expired or was revoked."""


class KeyValue(msgspec.Struct, frozen=True, gc=False):
    """One stored key: the revision that last modified it, its lease (0: none), and the
    revision that created it (a delete then a create at the same key is a new key).

    A listing of a large prefix makes tens of thousands of these; they hold no references
    to other objects, so they are kept out of the garbage collector's way (`gc=False`).
    """

    key: str
    value: bytes
    mod_revision: int
    lease: int = 0
    create_revision: int = 0


class KeyRevision(msgspec.Struct, frozen=True, gc=False):
    """A listed key whose value was left out (`Store.get_prefixes_changed`): it was last
    modified at `mod_revision`, at or before the revision the reader said it holds."""

    key: str
    mod_revision: int
    lease: int = 0
    create_revision: int = 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The items under a prefix and the store revision they were read at."""

    items: list[KeyValue]
    revision: int


@dataclass(frozen=True, slots=True)
class Listing:
    """The keys under prefixes and the revision they were read at, where the values of the
    keys not changed since the reader's revision may be left out (`KeyRevision`).

    `removed` None: `items` are every key. A list: the listing is a delta from the
    reader's revision (`since`): `items` are only the keys written since, as they are now
    (`KeyValue`), and `removed` the keys gone since (deleted, or their lease expired); a
    key in neither is as the reader holds it at `since`."""

    items: list[KeyValue | KeyRevision]
    revision: int
    removed: list[str] | None = None


@dataclass(frozen=True, slots=True)
class Put:
    """A key was created or changed at `revision`."""

    key: str
    value: bytes
    revision: int


@dataclass(frozen=True, slots=True)
class Delete:
    """A key was deleted (explicitly, or because its lease ended) at `revision`."""

    key: str
    revision: int


@dataclass(frozen=True, slots=True)
class Resync:
    """The full state of the watched prefix after a gap; consumers diff it against theirs."""

    items: list[KeyValue]
    revision: int


Event = Put | Delete | Resync

_T = TypeVar("_T")


class WatchQueue(asyncio.Queue[_T]):
    """The changes queued for one watch, and `bytes`, those of their keys and values (a
    `Put`'s or a `Delete`'s: a `Resync` is the state itself, not a backlog), kept as items
    are put and taken, never summed over the queue."""

    def __init__(self) -> None:
        self.bytes = 0
        super().__init__()

    def _put(self, item: _T) -> None:
        super()._put(item)
        self.bytes += change_bytes(item)

    def _get(self) -> _T:
        item = super()._get()
        self.bytes -= change_bytes(item)
        return item

    def drop(self) -> None:
        """Take every item queued and drop it (a backlog given up for a `Resync`)."""
        while not self.empty():
            self.get_nowait()


def change_bytes(item: object) -> int:
    """The bytes of a change's key and value (0 for anything else)."""
    if isinstance(item, Put):
        return len(item.key) + len(item.value)
    return len(item.key) if isinstance(item, Delete) else 0


def check_key(key: str) -> None:
    """Refuse a key that is empty, too long, or has characters outside the safe set."""
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"invalid key {key!r}: must be a non-empty string")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"invalid key {key[:60]!r}...: longer than {MAX_KEY_BYTES} bytes")
    if not _KEY_RE.match(key) or "//" in key or key.startswith("/"):
        raise InvalidKeyError(
            f"invalid key {key!r}: use letters, digits and ._-/:@+= with no empty segment"
        )


def check_prefix(prefix: str) -> None:
    """A prefix may be empty (everything) or follow the key rules."""
    if prefix:
        check_key(prefix)


def distinct_prefixes(prefixes: Sequence[str]) -> tuple[str, ...]:
    """`prefixes` checked, sorted, without those inside another ("" holds every key)."""
    for prefix in prefixes:
        check_prefix(prefix)
    if not prefixes:
        raise ValueError("no prefix given")
    kept: list[str] = []
    for prefix in sorted(set(prefixes)):
        if not kept or not prefix.startswith(kept[-1]):
            kept.append(prefix)
    return tuple(kept)


async def checked_items(items: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """`items` with each key and value checked as `put` checks them (the first refused
    raises), each value as `bytes`: what `put_many` writes, checked before it writes any.
    `CHECK_SLICE` items per turn of the event loop: 20,000 checked at once held it 25-43 ms."""
    items = list(items)  # (as given now: a caller's list may change while this yields)
    checked: list[tuple[str, bytes]] = []
    for start in range(0, len(items), CHECK_SLICE):
        if start:
            await asyncio.sleep(0)
        for key, value in items[start : start + CHECK_SLICE]:
            check_key(key)
            check_value(key, value)
            checked.append((key, bytes(value)))
    return checked


async def checked_keys(keys: Sequence[str]) -> list[str]:
    """`keys` each checked as `delete` checks it (the first refused raises), `CHECK_SLICE`
    per turn of the event loop: what `delete_many` deletes, checked before it deletes any,
    each once (a key given again can delete nothing, and would start another etcd
    transaction: 2,000 times one key were 2,000 round trips)."""
    keys = list(keys)  # (as given now: a caller's list may change while this yields)
    for start in range(0, len(keys), CHECK_SLICE):
        if start:
            await asyncio.sleep(0)
        for key in keys[start : start + CHECK_SLICE]:
            check_key(key)
    return list(dict.fromkeys(keys))


def check_value(key: str, value: bytes) -> None:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"value for {key!r} must be bytes, not {type(value).__name__}")
    if len(value) > MAX_VALUE_BYTES:
        raise ValueTooLargeError(
            f"value for key {key!r} is {len(value)} bytes, over the {MAX_VALUE_BYTES}-byte limit"
        )


@dataclass(eq=False)
class Lease:
    """A lease granted by a store. Keys put under it vanish when it ends.

    `lost` is set once the store says the lease no longer exists, or when no keepalive
    succeeded for a whole TTL: the holder must grant a new lease and re-put its keys
    (see `shoal.store.lease.LeaseKeeper`).
    """

    id: int
    ttl: float
    store: Store
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    last_renewed: float = field(default_factory=time.monotonic)
    _task: asyncio.Task[None] | None = None

    async def keepalive(self) -> None:
        """Renew the lease once; sets `lost` and raises `LeaseNotFoundError` if it is gone.

        A transport failure raises `StoreUnavailableError`; if renewals have failed for a
        whole TTL the lease is counted as lost, since the store has expired it by then.
        """
        if self.lost.is_set():
            raise LeaseNotFoundError(f"lease {self.id:x} is lost")
        # Renewed as of when it was asked, not when the answer came: the store renewed it in
        # between, and an answer that reached a process frozen (or a network slow) for a TTL
        # put a lease the store had expired meanwhile in force for one more TTL.
        asked = time.monotonic()
        try:
            alive = await self.store._keepalive(self.id, self.ttl)
        except Exception as exc:
            if time.monotonic() - self.last_renewed > self.ttl:
                self.lost.set()
            raise StoreUnavailableError(f"keepalive of lease {self.id:x} failed: {exc}") from exc
        if not alive:
            self.lost.set()
            raise LeaseNotFoundError(f"lease {self.id:x} no longer exists")
        self.last_renewed = max(self.last_renewed, asked)

    def start_keepalive(self) -> asyncio.Task[None]:
        """Renew in the background about every TTL/3 until the lease is lost or revoked."""
        if self._task is None:
            self._task = asyncio.create_task(self._keepalive_forever(), name=f"lease-{self.id:x}")
        return self._task

    def stop_keepalive(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _keepalive_forever(self) -> None:
        interval = max(self.ttl / 3, 0.05)
        while not self.lost.is_set():
            try:
                await self.keepalive()
            except LeaseNotFoundError:
                log.warning("lease %x lost", self.id)
                return
            except StoreUnavailableError as exc:
                log.debug("%s", exc)
                if self.lost.is_set():
                    log.warning("lease %x lost: no keepalive succeeded for %ss", self.id, self.ttl)
                    return
                await asyncio.sleep(min(interval, 0.5))
                continue
            await asyncio.sleep(interval)

    async def revoke(self) -> None:
        """End the lease now: its keys are deleted at once."""
        self.stop_keepalive()
        self.lost.set()
        await self.store.revoke(self.id)


class Store(abc.ABC):
    """A revisioned key-value store with leases and prefix watches. Open with `shoal.store.open_store`."""

    url: str

    def __init__(self) -> None:
        # Leases granted here whose keepalive runs in the background: `close()` stops them.
        self._kept_alive: set[Lease] = set()
        # Told when a watch of this instance loses the store (why) and has it back (None).
        self.watch_listeners: list[Callable[[StoreError | None], None]] = []

    def _watch_state(self, lost: StoreError | None) -> None:
        """Tell `watch_listeners` a watch lost the store (`lost`), or has it back (None)."""
        for listener in list(self.watch_listeners):
            try:
                listener(lost)
            except Exception:
                log.exception("store %s: a watch listener failed", self.url)

    def _stop_keepalives(self) -> None:
        """Stop the keepalive of every lease this instance renews (part of `close()`)."""
        for lease in list(self._kept_alive):
            lease.stop_keepalive()

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> Snapshot:
        """All keys under `prefix`, sorted by key, with the revision they were read at."""

    @abc.abstractmethod
    async def get_prefixes(
        self, prefixes: Sequence[str], *, on_answer: Callable[[], None] | None = None
    ) -> Snapshot:
        """All keys under any of `prefixes`, each once, sorted by key, read at one revision.
        `on_answer` is called once the store has answered (the first page of a listing
        read a page at a time): a deadline on the store's answer need not cover the size
        of what it lists."""

    async def get_prefixes_changed(
        self,
        prefixes: Sequence[str],
        since: int,
        *,
        on_answer: Callable[[], None] | None = None,
    ) -> Listing:
        """`get_prefixes`, where a key whose `mod_revision <= since` may come as a
        `KeyRevision`, without its value: a reader that holds the values of the keys it
        listed at `since` reads only what changed since. Every key is listed, whether its
        value is left out or not. This default sends every value (a correct superset); a
        backend that can skip the unchanged ones overrides it."""
        snap = await self.get_prefixes(prefixes, on_answer=on_answer)
        items: list[KeyValue | KeyRevision] = list(snap.items)
        return Listing(items, snap.revision)

    async def get(self, key: str) -> KeyValue | None:
        """One key, or None."""
        check_key(key)
        snap = await self.get_prefix(key)
        for kv in snap.items:
            if kv.key == key:
                return kv
        return None

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Create or replace `key`; returns the new store revision."""

    async def put_many(self, items: Sequence[tuple[str, bytes]], *, lease: int = 0) -> int:
        """Create or replace each key of `items` with its value, all under `lease` (a key
        given twice ends with its last value); returns the store revision of the last write
        (0 for no items).

        Every key and value is checked first, as `put` checks them (`CHECK_SLICE` per turn
        of the event loop): one refused raises before anything is written (a caller that
        wants the others written checks its items first, with `check_key` and
        `check_value`). The backend writes a bounded slice of keys per transaction, so one
        call may take several: a failure (the lease gone, the store out) may leave the
        earlier slices written. A watch gets one `Put` per key. This default puts them one
        at a time; each backend writes a slice per transaction."""
        revision = 0
        for key, value in await checked_items(items):
            revision = await self.put(key, value, lease=lease)
        return revision

    @abc.abstractmethod
    async def create(self, key: str, value: bytes, *, lease: int = 0) -> bool:
        """Atomically create `key` if absent; True if this call created it."""

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Delete `key`; True if it existed."""

    async def delete_many(self, keys: Sequence[str]) -> int:
        """Delete each of `keys` (one absent is skipped, one given twice deleted once);
        returns how many existed.

        Every key is checked first, as `delete` checks it (`CHECK_SLICE` per turn of the
        event loop): one refused raises before anything is deleted. The backend deletes a
        bounded slice of keys per transaction, so a failure (the store out) may leave the
        earlier slices deleted. A watch gets one `Delete` per key deleted. This default
        deletes them one at a time; each backend deletes a slice per transaction."""
        deleted = 0
        for key in await checked_keys(keys):
            deleted += await self.delete(key)
        return deleted

    @abc.abstractmethod
    async def _grant(self, ttl: float) -> int:
        """Create a lease and return its id (non-zero)."""

    @abc.abstractmethod
    async def _keepalive(self, lease_id: int, ttl: float) -> bool:
        """Renew a lease once; False if it no longer exists."""

    @abc.abstractmethod
    async def revoke(self, lease_id: int) -> None:
        """End a lease and delete its keys; a missing lease is not an error."""

    @abc.abstractmethod
    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[Event]:
        """Changes under `prefix` from `start_revision` on, in revision order.

        After a gap (lost connection, compacted history) yields a `Resync` with the full
        current state, then goes on from its revision + 1. Runs until cancelled; ends when
        the store is closed, and raises `StoreError` if it can no longer deliver changes.
        """

    @abc.abstractmethod
    def watch_prefixes(
        self, prefixes: Sequence[str], start_revision: int
    ) -> AsyncGenerator[Event, None]:
        """`watch` of several prefixes as one: the changes under any of them in revision
        order, and a `Resync` with the state of all of them at one revision."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections, end watches and stop keepalives. Leases are not revoked."""

    def set_unreachable(self, unreachable: bool) -> None:
        """Test seam, not for production code: cut this client off from its store (or let it
        back). While cut off its calls raise `StoreUnavailableError` and its watches miss
        changes; when let back, each of its watches yields a `Resync`, as after a dropped
        connection. The memory and SQLite stores implement it; a backend that cannot raises
        `NotImplementedError` (tests cut etcd off by stopping the server)."""
        raise NotImplementedError(f"{type(self).__name__} cannot cut one client off")

    async def grant(self, ttl: float, *, keepalive: bool = True) -> Lease:
        """Grant a lease of `ttl` seconds, renewed in the background unless `keepalive=False`."""
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        asked = time.monotonic()  # (granted no earlier: its TTL counts from then, as a renewal's)
        lease = Lease(id=await self._grant(ttl), ttl=ttl, store=self, last_renewed=asked)
        if keepalive:
            self._kept_alive.add(lease)
            lease.start_keepalive().add_done_callback(lambda _: self._kept_alive.discard(lease))
        return lease

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
