"""`CardsAndInstances`: the join of model cards to endpoint instances that every discovery
reader goes through. The store values it takes are parsed into records by `values`.

A frontend holds a whole fleet here, twice (its listing and its watch stream read the same
query), so what it holds per instance is kept small:
- the readers of one query share what they parsed (`peers`): one card, one instance
  record, one key string per store key, however many readers hold it;
- each reader indexes by store key (`ModelKey.key` is one), three dict entries per
  instance: cards, instances and the models reported;
- the cards of one model share what they repeat (`values.compact_card`: names, file
  checksums and sizes, kinds, numbers), and carry their `mdcsum` in `ModelInstance`, not
  in a per-card cache;
- the records are kept out of the garbage collector's way (`gc=False`): they hold no
  reference cycles, and a collector pass over a hundred thousand of them holds the loop.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import weakref
from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import attrgetter, is_, ne

from prometheus_client import Counter

from shoal.cards import CardError, ModelCard
from shoal.discovery.keys import INSTANCES, MODELS, ModelKey, Query, parse_model_key
from shoal.discovery.records import (
    Added,
    DiscoveryEvent,
    ModelInstance,
    Removed,
    TaintsUpdated,
)
from shoal.discovery.values import (
    HeldCard,
    HeldInstance,
    Skipped,
    check_size,
    compact_card,
    held_revisions,
    parse_instance,
    report_malformed,
)
from shoal.store import KeyRevision, KeyValue

log = logging.getLogger(__name__)

IGNORED_CHANGES = Counter(
    "shoal_discovery_ignored_card_changes_total",
    "Changes to a registered card other than its taints, which watchers ignore.",
)

LIST_BATCH = 64
"""Values (or keys) a listing or a `Resync` goes through between two yields to the event
loop: ten thousand of them must not hold up the requests a frontend serves meanwhile."""
RESORT_AFTER = 1024
"""Models moved since the last listing past which `listing()` sorts them all again, rather
than moving each into place."""

IGNORED = "a change other than its taints was ignored: the registered card is kept"

SCAN_SLICE = 2048
"""Values of a listing checked against what is held in one go (in C loops), between two
yields to the event loop."""

_by_key = attrgetter("key.key")  # the order of listings: store order
_key = attrgetter("key")
_mod_revision = attrgetter("mod_revision")


class _Absent:
    """What a listing's key not held is checked against: no value has this revision."""

    mod_revision = -1


_ABSENT = _Absent()


async def release(
    items: list[KeyValue] | list[KeyValue | KeyRevision], pause_every: int = LIST_BATCH
) -> None:
    """Empty `items` (a listing, or a `Resync`, once applied: each is a list of its own) a
    slice at a time, yielding to the event loop between slices: the values of a hundred
    thousand keys, freed at once when the last reference goes, held the loop ~20 ms."""
    step = pause_every * 16
    while items:
        del items[-step:]
        await asyncio.sleep(0)


class CardsAndInstances:
    """The model cards and endpoint instances of one query as last read from the store, and
    the routable models (each card joined to its instance) last reported from them.

    Every reader goes through here: `Discovery.list` keeps one per query between listings,
    and each `list_and_watch` stream has its own. Store changes go in as the store reports
    them (`put`, `delete`, and `replace_all` for a listing or a `Resync` of the query),
    each returning the model keys whose join may have moved; `report` turns those into
    events.

    The rules, which make a listing, a watch and a late reader agree:
    - A card held at a key's `create_revision` changes only in its taints: a write at the
      same `create_revision` that changes anything else is ignored (counted, logged, listed
      in `skipped`), and the card held is kept. Conversely a write at a new
      `create_revision` is a new registration: what was held for the key no longer counts,
      even when the new value is malformed.
    - A malformed value is listed in `skipped`; it never replaces or removes the valid
      value held at the same `create_revision`.
    - A value is parsed once per (`create_revision`, `mod_revision`): `replace_all` skips a
      key read at the revisions its value is held at. A value not held (malformed, or a
      change ignored) is parsed, and reported, on every `replace_all` that reads it.
    - `peers`, the other readers of the same query (a frontend's listing and its watch
      stream), share what they parsed: a value one of them holds at the revisions read is
      taken from it, not parsed again, so one fleet is held in memory once, not per reader.
    """

    def __init__(
        self, skipped: Skipped, peers: weakref.WeakSet[CardsAndInstances] | None = None
    ) -> None:
        self.skipped = skipped
        self.peers: weakref.WeakSet[CardsAndInstances] = (
            weakref.WeakSet() if peers is None else peers
        )
        self.peers.add(self)
        # The cards and instances held, by store key (`ModelKey.key` is a card's).
        self.held: dict[str, HeldCard | HeldInstance] = {}
        # The adapter cards of each instance (by its store key); its base card is found by
        # its key, so an instance with none (most of them) has no entry.
        self.adapters: dict[str, list[ModelKey]] = {}
        self.reported: dict[ModelKey, ModelInstance] = {}
        self._listing: list[ModelInstance] | None = None  # `reported`, in key order
        self._moved: set[ModelKey] = set()  # in `reported` since `_listing` was sorted

    def copy(self) -> CardsAndInstances:
        """A new reader holding what this one holds, and a peer of the same readers: what a
        stream that starts from a listing begins with (its records are shared, its dicts
        its own)."""
        other = CardsAndInstances(self.skipped, self.peers)
        other.held = dict(self.held)
        other.adapters = {key: list(keys) for key, keys in self.adapters.items()}
        other.reported = dict(self.reported)
        return other

    def _others(self) -> list[CardsAndInstances]:
        return [peer for peer in self.peers if peer is not self]

    def put(
        self, kv_key: str, value: bytes, create_revision: int, mod_revision: int
    ) -> list[ModelKey]:
        """A value written at `kv_key`. A watch's `Put` does not carry the key's
        `create_revision` and passes 0: the one held (an in-place change), or `mod_revision`
        when none is held (a create's revision is its create revision)."""
        held = self.held.get(kv_key)
        if not create_revision:
            create_revision = mod_revision if held is None else held.create_revision
        touched: list[ModelKey] = []
        revisions = held_revisions(create_revision, mod_revision)
        self._put(held, kv_key, value, revisions, touched, self._others())
        return touched

    def _put(
        self,
        held: HeldInstance | HeldCard | None,
        kv_key: str,
        value: bytes,
        read_at: tuple[int, int],
        touched: list[ModelKey],
        others: list[CardsAndInstances],
    ) -> None:
        """Take `value`, read at `read_at` (create_revision, mod_revision), over the value
        `held` at `kv_key`; add the model keys this may move to `touched`."""
        if held is not None and held.create_revision != read_at[0]:
            touched.extend(self.delete(kv_key))  # a new registration at the key
        if kv_key.startswith(INSTANCES):
            touched.extend(self._put_instance(kv_key, value, read_at, others))
        else:
            touched.extend(self._put_card(kv_key, value, read_at, others))

    def _take_from_peer(
        self,
        held: HeldInstance | HeldCard | None,
        kv_key: str,
        read_at: tuple[int, int],
        touched: list[ModelKey],
        others: list[CardsAndInstances],
    ) -> bool:
        """Take the value at `kv_key`, read at `read_at` but not sent, from a peer that
        holds it at exactly `read_at`; False if no peer does."""
        for peer in others:
            theirs = peer.held.get(kv_key)
            if theirs is not None and (theirs.create_revision, theirs.mod_revision) == read_at:
                # `_put` takes the peer's record, as for a value sent: it never parses this one
                self._put(held, kv_key, b"", read_at, touched, others)
                return True
        return False

    def _put_instance(
        self, kv_key: str, value: bytes, read_at: tuple[int, int], others: list[CardsAndInstances]
    ) -> Iterable[ModelKey]:
        shared = None
        for peer in others:
            theirs = peer.held.get(kv_key)
            if isinstance(theirs, HeldInstance) and (
                (theirs.create_revision, theirs.mod_revision) == read_at
            ):
                shared = theirs
                break
        if shared is None:
            try:
                info = parse_instance(kv_key, value)
            except ValueError as exc:
                report_malformed("instance", kv_key, exc, self.skipped)
                return ()
            shared = HeldInstance(kv_key, info, *read_at)
        self.skipped.pop(kv_key, None)
        self.held[shared.kv_key] = shared
        return self._cards_of(kv_key)

    def _cards_of(self, instance_key: str) -> list[ModelKey]:
        """The keys of the cards held for the instance at `instance_key`."""
        base = self.held.get(MODELS + instance_key[len(INSTANCES) :])
        adapters = self.adapters.get(instance_key, ())
        return [base.key, *adapters] if isinstance(base, HeldCard) else list(adapters)

    def _put_card(
        self, kv_key: str, value: bytes, read_at: tuple[int, int], others: list[CardsAndInstances]
    ) -> Iterable[ModelKey]:
        shared = None
        for peer in others:
            theirs = peer.held.get(kv_key)
            if isinstance(theirs, HeldCard) and (
                (theirs.create_revision, theirs.mod_revision) == read_at
            ):
                shared = theirs
                break
        if shared is not None:
            key, card, mdcsum = shared.key, shared.card, shared.mdcsum
        else:
            try:
                key = parse_model_key(kv_key)
                check_size(value)
                card, mdcsum = compact_card(ModelCard.from_json(value))
            except (ValueError, CardError) as exc:
                report_malformed("model", kv_key, exc, self.skipped)
                return ()
        held = self.held.get(kv_key)
        if isinstance(held, HeldCard) and not held.card.same_except_taints(card):
            IGNORED_CHANGES.inc()
            log.warning("ignoring a change to registered card %s other than its taints", key)
            self.skipped[kv_key] = IGNORED
            return ()
        self.skipped.pop(kv_key, None)
        if held is None and key.suffix is not None:
            self.adapters.setdefault(key.instance_key, []).append(key)
        self.held[key.key] = shared or HeldCard(key, card, mdcsum, *read_at)
        return (key,)

    def delete(self, kv_key: str) -> Iterable[ModelKey]:
        """`kv_key` was deleted: its value, if one is held, is gone."""
        self.skipped.pop(kv_key, None)
        held = self.held.pop(kv_key, None)
        if held is None:
            return ()
        if isinstance(held, HeldInstance):
            return self._cards_of(kv_key)
        key = held.key
        if key.suffix is not None:
            adapters = self.adapters[key.instance_key]
            adapters.remove(key)
            if not adapters:
                del self.adapters[key.instance_key]
        return (key,)

    async def replace_all(
        self,
        query: Query,
        items: Sequence[KeyValue | KeyRevision],
        pause_every: int = LIST_BATCH,
        *,
        needed: list[KeyRevision] | None = None,
    ) -> list[ModelKey]:
        """The whole of `query`'s two prefixes, read at one revision (a listing, or a
        `Resync`): every held key it lacks is gone. Yields to the event loop every
        `pause_every` values parsed (0: never), and after every `SCAN_SLICE` values looked up.

        A value is held if its `mod_revision` is (every write to the store has its own
        revision): a slice of a listing is checked against what is held in a few C loops,
        not a Python step per key, and only the values not held go through `_put`.

        A key listed without its value (`KeyRevision`, from `Store.get_prefixes_changed`) is
        taken as it is held only when this reader, or a peer, holds it at exactly the
        listed revisions; any other (a value skipped as malformed, a change ignored, a key
        this reader never read) is added to `needed`, for the caller to read its value
        and `put` it. Such a key is listed, so it is not gone: what is held for it stays
        until its value comes."""
        touched: list[ModelKey] = []
        others = self._others()
        held = self.held
        held_before, held_seen = len(held), 0
        parsed = 0
        for start in range(0, len(items), SCAN_SLICE):
            chunk = items[start : start + SCAN_SLICE]
            helds = list(map(held.get, map(_key, chunk), repeat(_ABSENT)))
            held_seen += len(chunk) - sum(map(is_, helds, repeat(_ABSENT)))
            changed = map(ne, map(_mod_revision, helds), map(_mod_revision, chunk))
            for kv, was in compress(zip(chunk, helds, strict=True), changed):
                read_at = held_revisions(kv.create_revision, kv.mod_revision)
                held_now = was if isinstance(was, HeldCard | HeldInstance) else None
                if isinstance(kv, KeyRevision):
                    if not self._take_from_peer(held_now, kv.key, read_at, touched, others):
                        if needed is None:
                            raise ValueError(f"{kv.key} listed without its value")
                        needed.append(kv)
                    continue
                self._put(held_now, kv.key, kv.value, read_at, touched, others)
                parsed += 1
                if pause_every and parsed % pause_every == 0:
                    await asyncio.sleep(0)
            if pause_every:
                await asyncio.sleep(0)
        prefixes = (query.instances_prefix, query.models_prefix)
        skipped = [k for k in self.skipped if k.startswith(prefixes)]
        if held_seen < held_before or skipped:  # something may be gone: find what
            seen: set[str] = set()
            for start in range(0, len(items), SCAN_SLICE):
                seen.update(map(_key, items[start : start + SCAN_SLICE]))
                if pause_every:
                    await asyncio.sleep(0)
            for i, kv_key in enumerate(list(held), 1):
                if kv_key not in seen:
                    touched.extend(self.delete(kv_key))
                if pause_every and i % pause_every == 0:
                    await asyncio.sleep(0)
            for kv_key in skipped:
                if kv_key not in seen:
                    self.skipped.pop(kv_key, None)  # no longer in the store
        return touched

    async def apply_changes(
        self, items: Sequence[KeyValue | KeyRevision], removed: Sequence[str]
    ) -> list[ModelKey]:
        """A delta listing (`Listing.removed`) from the revision this reader holds: `items`
        were written since, `removed` are gone since; every other key is as held. Yields
        to the event loop every `LIST_BATCH` values parsed and keys removed."""
        touched: list[ModelKey] = []
        others = self._others()
        held = self.held
        parsed = 0
        for kv in items:
            was = held.get(kv.key)
            if was is not None and was.mod_revision == kv.mod_revision:
                continue  # (held already: a peer's value, or one read since)
            if isinstance(kv, KeyRevision):
                raise ValueError(f"{kv.key} listed as changed without its value")
            read_at = held_revisions(kv.create_revision, kv.mod_revision)
            self._put(was, kv.key, kv.value, read_at, touched, others)
            parsed += 1
            if parsed % LIST_BATCH == 0:
                await asyncio.sleep(0)
        for i, kv_key in enumerate(removed, 1):
            touched.extend(self.delete(kv_key))
            # (a whole fleet may go at once: its lease ended, seen by a reader that cannot reap)
            if i % LIST_BATCH == 0:
                await asyncio.sleep(0)
        return touched

    async def report(
        self, keys: Iterable[ModelKey], pause_every: int = LIST_BATCH
    ) -> list[DiscoveryEvent]:
        """The events that bring a reader of `reported` up to date on `keys`: arrivals and
        changes in key order, then departures in key order, so a consumer applying them one
        by one never loses a model that only moved to another key (a worker re-registered
        under a new lease, seen in one `Resync` with its old registration's end). Yields to
        the event loop every `pause_every` keys (0: never)."""
        events: list[DiscoveryEvent] = []
        departures: list[DiscoveryEvent] = []
        others = self._others()
        # (`keys` come in store order, in a run or two: sorting them costs little.)
        for i, key in enumerate(sorted(dict.fromkeys(keys), key=ModelKey.sort_key), 1):
            if pause_every and i % pause_every == 0:
                await asyncio.sleep(0)
            before, now = self._rejoin(key, others)
            if now is before:
                continue
            if now is None:
                departures.append(Removed(key))
            elif before is None:
                events.append(Added(now))
            elif before.instance != now.instance or (
                before.card is not now.card and not before.card.same_except_taints(now.card)
            ):  # a new instance, or a new registration at the key
                events.extend((Removed(key), Added(now)))
            elif before.card.taints != now.card.taints or before.revision != now.revision:
                events.append(TaintsUpdated(key, now.card.taints, now.revision))
        return events + departures

    async def catch_up(self, keys: Sequence[ModelKey]) -> None:
        """`report`, for a reader that needs `reported` only, not the events. Yields to the
        event loop every `LIST_BATCH` keys."""
        others = self._others()
        for i, key in enumerate(keys, 1):
            if i % LIST_BATCH == 0:
                await asyncio.sleep(0)
            self._rejoin(key, others)

    def _rejoin(
        self, key: ModelKey, others: list[CardsAndInstances]
    ) -> tuple[ModelInstance | None, ModelInstance | None]:
        """Join the card at `key` to its instance again: the model reported before, and the
        one now (None: not routable), both None or the same one when it did not move."""
        before = self.reported.get(key)
        held = self.held.get(key.key)
        instance = None if held is None else self.held.get(key.instance_key)
        if not isinstance(held, HeldCard) or not isinstance(instance, HeldInstance):
            if before is not None:
                del self.reported[key]
                self._moved_in_listing(key)
            return before, None
        info = instance.info
        if (
            before is not None
            and before.card is held.card
            and before.instance is info
            and before.revision == held.mod_revision
        ):
            return before, before
        now = None
        for peer in others:  # the same model reported by another reader: shared
            theirs = peer.reported.get(key)
            if (
                theirs is not None
                and theirs.card is held.card
                and theirs.instance is info
                and theirs.revision == held.mod_revision
            ):
                now = theirs
                break
        if now is None:
            now = ModelInstance(held.key, held.card, info, held.mod_revision, held.mdcsum)
        self.reported[now.key] = now
        self._moved_in_listing(key)
        return before, now

    def _moved_in_listing(self, key: ModelKey) -> None:
        if self._listing is not None:
            if len(self._moved) < RESORT_AFTER:
                self._moved.add(key)
            else:
                self._listing = None  # sorted again, whole, when next asked
                self._moved.clear()

    def listing(self) -> list[ModelInstance]:
        """The models reported, in key order: sorted whole the first time, then each model
        that moved is moved into place (a listing of a hundred thousand models is not sorted
        again, holding the event loop, because one of them changed)."""
        listing = self._listing
        if listing is None:
            listing = self._listing = sorted(self.reported.values(), key=_by_key)
        for key in self._moved:
            i = bisect.bisect_left(listing, key.key, key=_by_key)
            here = i < len(listing) and listing[i].key == key
            now = self.reported.get(key)
            if now is None:
                if here:
                    del listing[i]
            elif here:
                listing[i] = now
            else:
                listing.insert(i, now)
        self._moved.clear()
        return list(listing)
