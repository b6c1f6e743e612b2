"""`Discovery`: endpoint instances, model cards and taints, kept in the store.

A model instance is routable when both its card (`shoal/v1/models/...`) and its endpoint
instance (`shoal/v1/instances/...`, which holds the request URL) are present. One join,
`CardsAndInstances`, turns what the store holds into routable models, for `Discovery.list`
and for `Discovery.list_and_watch` alike, so every reader sees the same models:

- A card is immutable while its key lives, except its taints: a write at the key's
  `create_revision` that changes anything else is logged and ignored, and the registered
  card is kept. Conversely a key whose `create_revision` changed was deleted and created
  again (a worker detached a model and attached another): a new registration, taken as it
  is, even by a listing or a `Resync` that never saw the delete.
- A malformed value (nested deeper than `shoal.bounds.MAX_DEPTH` included) is reported,
  counted and skipped; it never hides or removes a valid one, nor stops a stream.
  `Discovery.skipped` lists the keys whose value is not used, and why.
- `ModelInstance.revision` is the `mod_revision` of the card's value: every reader of the
  store sees the same one, so cards are ordered alike everywhere.
- Instances and cards are read as one: a listing reads both prefixes at one revision
  (`Store.get_prefixes`), and `list_and_watch` follows them with one watch
  (`Store.watch_prefixes`) from that revision + 1, so no change is missed or seen twice,
  changes come in revision order, and a `Resync` replaces both at one revision. The join
  never holds instances from a later revision than cards (or the reverse): a worker that
  re-registers under a new lease before its old one ends is never seen without a
  routable instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, MutableSequence, Sequence

import msgspec

from shoal.cards import CardError, ModelCard
from shoal.discovery.join import LIST_BATCH, CardsAndInstances, release
from shoal.discovery.keys import EndpointId, ModelKey, Query, instance_key
from shoal.discovery.records import (
    Added,
    DiscoveryEvent,
    InstanceInfo,
    ModelInstance,
    Removed,
    TaintsUpdated,
)
from shoal.discovery.values import Skipped, parse_instance, report_malformed
from shoal.store import InvalidKeyError, KeyRevision, Put, Resync, Store
from shoal.store.base import check_key

__all__ = [
    "Added",
    "CardsAndInstances",
    "Discovery",
    "DiscoveryEvent",
    "InstanceInfo",
    "ModelConflictError",
    "ModelInstance",
    "Removed",
    "TaintsUpdated",
]

MAX_VALUE_READS = 64
"""Values a listing reads one key at a time, when what it left out is not held (malformed,
a change ignored); past that many it lists the query again, every value included."""
WHOLE_LISTING_EVERY = 300.0
"""Seconds after which `list` reads every value again rather than what changed since its
last listing: a backstop for what a delta cannot see (a store restored from a backup to a
history that diverged from the one the reader followed, which reused its revisions)."""
MAX_LISTINGS = 32
"""Listings of one `Discovery` in flight at once (`list`, and the first listing of each
`list_and_watch`): a frontend that starts thousands of streams together does not send
thousands of reads to the store together, which would time them all out."""


class ModelConflictError(Exception):
    """The endpoint instance already serves a different model under this key."""


async def _paced(events: list[DiscoveryEvent]) -> AsyncIterator[DiscoveryEvent]:
    """`events`, yielding to the event loop after every `LIST_BATCH` of them."""
    for i, event in enumerate(events, 1):
        yield event
        if i % LIST_BATCH == 0:
            await asyncio.sleep(0)


class Discovery:
    """Register, list and watch endpoint instances and model cards in a store.

    Workers write (`register_*`, `update_taints`); frontends and tools read (`list`,
    `list_and_watch`), both through `CardsAndInstances`: a reader that saw the same store
    changes has the same models whether it listed them or watched them, and the same
    `skipped`. `list` remembers, per query, what it read, so each listing parses only
    what changed since the last.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        # What the last complete `list` of each query read, and the revision it is up to
        # date with, for the next one to start from (and list only the values changed since).
        self._listed: dict[Query, CardsAndInstances] = {}
        self._listed_at: dict[Query, int] = {}
        self._whole_at: dict[Query, float] = {}  # (when the last listing of every value ran)
        # Every reader of each query (its listing, its streams), sharing what they parsed.
        self._readers: dict[Query, weakref.WeakSet[CardsAndInstances]] = {}
        # Listings in flight by query, and the queries forgotten while one was: not kept.
        self._listing: dict[Query, int] = {}
        self._forgotten: set[Query] = set()
        self._listing_slots = asyncio.Semaphore(MAX_LISTINGS)
        # Keys read and not used (malformed, or a change ignored), with the reason.
        self.skipped: Skipped = {}

    # -- writing (workers) --------------------------------------------------------------

    async def register_instance(self, info: InstanceInfo, *, lease: int) -> None:
        key = instance_key(info.endpoint_id, info.instance_id)
        await self.store.put(key, msgspec.json.encode(info), lease=lease)

    async def unregister_instance(self, endpoint: EndpointId, instance_id: int) -> None:
        await self.store.delete(instance_key(endpoint, instance_id))

    async def register_model(self, key: ModelKey, card: ModelCard, *, lease: int) -> None:
        """Announce `card` at `key`. Refuses a different model where one is registered."""
        data = card.to_json()
        if await self.store.create(key.key, data, lease=lease):
            return
        existing = await self.store.get(key.key)
        if existing is not None:
            try:
                old = ModelCard.from_json(existing.value)
            except CardError:
                old = None
            if old is not None and old.mdcsum != card.mdcsum:
                raise ModelConflictError(
                    f"endpoint instance {key} already serves model {old.display_name!r} "
                    f"(mdcsum {old.mdcsum}); refusing to register {card.display_name!r} "
                    f"(mdcsum {card.mdcsum}): detach it first"
                )
        await self.store.put(key.key, data, lease=lease)

    async def unregister_model(self, key: ModelKey) -> None:
        await self.store.delete(key.key)

    async def update_taints(self, key: ModelKey, taints: Iterable[str]) -> ModelCard:
        """Replace the taints of a registered card, keeping its lease."""
        kv = await self.store.get(key.key)
        if kv is None:
            raise KeyError(f"no model registered at {key}")
        card = ModelCard.from_json(kv.value).with_taints(list(taints))
        await self.store.put(key.key, card.to_json(), lease=kv.lease)
        return card

    # -- reading (frontends, tools) -----------------------------------------------------

    async def list_instances(self, query: Query | None = None) -> list[InstanceInfo]:
        query = query or Query()
        snap = await self.store.get_prefix(query.instances_prefix)
        instances: list[InstanceInfo] = []
        for kv in snap.items:
            try:
                instances.append(parse_instance(kv.key, kv.value))
            except ValueError as exc:
                report_malformed("instance", kv.key, exc, None)
        return instances

    async def list(
        self, query: Query | None = None, *, on_answer: Callable[[], None] | None = None
    ) -> list[ModelInstance]:
        """Routable models in scope: cards whose endpoint instance is registered.
        `on_answer` is called once the store has answered, before the values are parsed.

        Each listing starts from what the last one of the same query read (one
        `CardsAndInstances` per query): the store sends only the values changed since that
        listing's revision (`Store.get_prefixes_changed`), a value at the revisions it was
        read at is not parsed again, and a model that did not move is the same
        `ModelInstance`. A value left out that the join does not hold at the listed
        revision (malformed, a change ignored) is read again (`_read_needed`). A store whose
        change log reaches that revision answers with a delta instead (`Listing.removed`:
        SQLite): the keys written and the keys gone since, applied to the join
        (`apply_changes`), so a quiet fleet costs nothing per key; a malformed value or an
        ignored change is then reported once per write, not once per listing. Parsing
        yields to the event loop every `LIST_BATCH` values: a listing of ten thousand
        instances must not hold up the requests a frontend serves meanwhile.
        """
        query = query or Query()
        prefixes = (query.instances_prefix, query.models_prefix)
        self._listing[query] = self._listing.get(query, 0) + 1
        try:
            # Taken out while it is updated: a listing that fails or is cancelled half-way,
            # or runs beside another of the same query, never leaves a half-updated join.
            join = self._listed.pop(query, None) or self._reader(query)
            since = self._listed_at.pop(query, 0)
            now = time.monotonic()
            if now - self._whole_at.get(query, now - WHOLE_LISTING_EVERY) >= WHOLE_LISTING_EVERY:
                since = 0
            async with self._listing_slots:
                listing = await self.store.get_prefixes_changed(
                    prefixes, since, on_answer=on_answer
                )
            needed: list[KeyRevision] = []
            if listing.removed is not None:  # (a delta from `since`, which `join` holds)
                touched = await join.apply_changes(listing.items, listing.removed)
            else:
                touched = await join.replace_all(query, listing.items, needed=needed)
            revision = listing.revision
            await release(listing.items)
            del listing
            if needed:
                revision = await self._read_needed(query, join, needed, revision, touched)
            await join.catch_up(touched)
            if query not in self._forgotten:
                self._listed[query] = join
                self._listed_at[query] = revision
                if not since:
                    self._whole_at[query] = now
            return join.listing()
        finally:
            self._listing[query] -= 1
            if not self._listing[query]:
                del self._listing[query]
                self._forgotten.discard(query)

    async def _read_needed(
        self,
        query: Query,
        join: CardsAndInstances,
        needed: Sequence[KeyRevision],
        revision: int,
        touched: MutableSequence[ModelKey],
    ) -> int:
        """Give `join` the values a listing at `revision` left out and it does not hold at
        the listed revisions; the revision `join` is then up to date with. A value read
        alone is the listed one if its key still has the listed revisions (every write has
        its own); if not (it changed since, or there are over `MAX_VALUE_READS`), the query
        is listed again with every value: one consistent listing, never a mix."""
        readable = []
        for kv in needed:
            try:
                check_key(kv.key)
            except InvalidKeyError as exc:
                # (a key an outside writer put, which no reader can read alone; it never
                # parses either: skipped, as its first listing found it)
                if kv.key not in join.skipped:
                    report_malformed(
                        "model" if kv.key.startswith(query.models_prefix) else "instance",
                        kv.key,
                        exc,
                        join.skipped,
                    )
                continue
            readable.append(kv)
        needed = readable
        if len(needed) <= MAX_VALUE_READS:
            kvs = [await self.store.get(kv.key) for kv in needed]
            if all(
                got is not None
                and (got.mod_revision, got.create_revision) == (kv.mod_revision, kv.create_revision)
                for got, kv in zip(kvs, needed, strict=True)
            ):
                for got in kvs:
                    assert got is not None
                    touched.extend(
                        join.put(got.key, got.value, got.create_revision, got.mod_revision)
                    )
                return revision
        async with self._listing_slots:
            snap = await self.store.get_prefixes((query.instances_prefix, query.models_prefix))
        touched.extend(await join.replace_all(query, snap.items))
        await release(snap.items)
        return snap.revision

    def _reader(self, query: Query) -> CardsAndInstances:
        """A new reader of `query`, sharing what the others parse."""
        readers = self._readers.get(query)
        if readers is None or not readers:
            readers = self._readers[query] = weakref.WeakSet()
        return CardsAndInstances(self.skipped, readers)

    def forget(self, query: Query) -> None:
        """Drop what `list` keeps of `query` (a namespace that left a reader's scope): its
        listings would otherwise stay in memory for good. A listing of `query` in flight
        now does not keep what it read either."""
        self._listed.pop(query, None)
        self._listed_at.pop(query, None)
        self._whole_at.pop(query, None)
        self._readers.pop(query, None)
        if query in self._listing:
            self._forgotten.add(query)

    async def list_and_watch(
        self,
        query: Query | None = None,
        *,
        after_listing: bool = False,
        on_listed: Callable[[], None] | None = None,
    ) -> AsyncIterator[DiscoveryEvent]:
        """The models in scope as `Added` events, then every change, with no gap.
        `on_listed` is called once the consumer has taken the listing's last event (it has
        applied the listing when it applies each event as it comes), before any change.

        `after_listing`: the consumer applies the last `list(query)` itself (a frontend's
        start lists every query, then watches): the stream starts from that listing, at its
        revision, with no listing of its own, and reports only the changes after it. At
        100,000 instances that spares the store a second listing of 200,000 keys and the
        frontend's loop their parsing and 100,000 `Added` it already has. The listing is
        taken when the stream is first read; without a complete one held (none yet, or one
        in flight), the stream lists as without `after_listing`.

        Instances and cards are read at one revision, then followed by one store watch of
        both from that revision + 1 (`Store.watch_prefixes`). A store `Resync` (after a lost
        connection, or for a consumer that fell behind) holds both at one revision and
        becomes the events that bring the consumer up to date. Nothing is buffered here: a
        consumer that does not read holds back the store's watch, whose own bounded
        backlog turns into a `Resync`. The stream ends when the store is closed, and raises
        what the store watch raised.
        """
        query = query or Query()
        prefixes = (query.instances_prefix, query.models_prefix)
        listed = self._listed.get(query) if after_listing else None
        if listed is not None:
            join, revision = listed.copy(), self._listed_at[query]
        else:
            join = self._reader(query)
            async with self._listing_slots:
                snap = await self.store.get_prefixes(prefixes)
            # A snapshot (here, and in a `Resync`) is applied to the stream's own join, then
            # reported; both yield to the event loop every `LIST_BATCH` values or events: the
            # first listing of 20,000 models held a frontend's loop ~0.5 s. A consumer
            # applying the events meanwhile is never worse off: arrivals come before
            # departures.
            touched = await join.replace_all(query, snap.items)
            revision = snap.revision
            # This generator lives as long as the stream: it must not keep the values it
            # read (at 30,000 instances the snapshot's bytes were a third of a frontend's
            # memory).
            await release(snap.items)
            del snap
            async for event in _paced(await join.report(touched)):
                yield event
            del touched
        if on_listed is not None:
            on_listed()
        watch = self.store.watch_prefixes(prefixes, revision + 1)
        # Store events and the events they report, since the last yield to the event loop:
        # a store hands a burst (a catch-up after a cut: thousands of changes) without one.
        handled = 0
        async with contextlib.aclosing(watch):
            async for ev in watch:
                if isinstance(ev, Resync):
                    keys = await join.replace_all(query, ev.items)
                    await release(ev.items)
                elif isinstance(ev, Put):
                    keys = join.put(ev.key, ev.value, 0, ev.revision)
                else:
                    keys = list(join.delete(ev.key))
                del ev  # (nor the last `Resync`'s)
                handled += 1
                for event in await join.report(keys):
                    if handled >= LIST_BATCH:
                        handled = 0
                        await asyncio.sleep(0)
                    handled += 1
                    yield event
                if handled >= LIST_BATCH:
                    handled = 0
                    await asyncio.sleep(0)
