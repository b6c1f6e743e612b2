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
import logging
import sys
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
from prometheus_client import Counter

from shoal.bounds import check_json_depth
from shoal.cards import CardError, ModelCard
from shoal.discovery.keys import (
    INSTANCES,
    MODELS,
    EndpointId,
    ModelKey,
    Query,
    instance_key,
    parse_instance_key,
    parse_model_key,
)
from shoal.kv import KvEndpoint
from shoal.store import KeyValue, Put, Resync, Store

log = logging.getLogger(__name__)

MALFORMED = Counter(
    "shoal_discovery_malformed_values_total",
    "Values in the discovery store that could not be parsed and were skipped.",
    ["kind"],
)
IGNORED_CHANGES = Counter(
    "shoal_discovery_ignored_card_changes_total",
    "Changes to a registered card other than its taints, which watchers ignore.",
)


class ModelConflictError(Exception):
    """The endpoint instance already serves a different model under this key."""


class InstanceInfo(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """An endpoint instance: where requests go (`url`) and where its status server is.

    Unknown fields are ignored and unset optional ones are not written, so a newer worker's
    record stays readable by an older frontend, as cards do."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    url: str
    status_url: str
    kv_events: KvEndpoint | None = None  # where it publishes KV cache events, if it does

    @property
    def endpoint_id(self) -> EndpointId:
        return EndpointId(self.namespace, self.component, self.endpoint)


@dataclass(frozen=True, slots=True)
class ModelInstance:
    """A routable model: its card, served by a live endpoint instance.

    `revision` is the store revision that last wrote the card (its mod_revision; 0 when not
    known): every reader of the store sees the same one, so it can order cards everywhere.
    """

    key: ModelKey
    card: ModelCard
    instance: InstanceInfo
    revision: int = 0

    @property
    def instance_id(self) -> int:
        return self.key.instance_id

    @property
    def url(self) -> str:
        return self.instance.url


@dataclass(frozen=True, slots=True)
class Added:
    model: ModelInstance


@dataclass(frozen=True, slots=True)
class Removed:
    key: ModelKey


@dataclass(frozen=True, slots=True)
class TaintsUpdated:
    """The card at `key` was written again (at `revision`) with these taints."""

    key: ModelKey
    taints: tuple[str, ...]
    revision: int = field(default=0, compare=False)  # an event's content is key and taints


DiscoveryEvent = Added | Removed | TaintsUpdated

LIST_BATCH = 64
"""Values (or keys) a listing or a `Resync` goes through between two yields to the event
loop: ten thousand of them must not hold up the requests a frontend serves meanwhile."""
MAX_LISTINGS = 32
"""Listings of one `Discovery` in flight at once (`list`, and the first listing of each
`list_and_watch`): a frontend that starts thousands of streams together does not send
thousands of reads to the store together, which would time them all out."""

_instance_decoder = msgspec.json.Decoder(InstanceInfo)

InstanceId = tuple[EndpointId, int]
"""An endpoint instance as its store key names it: the endpoint and the instance id."""

Skipped = dict[str, str]
"""Store keys whose value is not used, with the reason: malformed, or a change ignored."""

IGNORED = "a change other than its taints was ignored: the registered card is kept"


def _report_malformed(kind: str, kv_key: str, error: Exception, skipped: Skipped | None) -> None:
    """Count and log a value that cannot be used (`kind`: "model" or "instance"), and list
    it in `skipped` if given."""
    MALFORMED.labels(kind).inc()
    if kind == "model":
        log.error("skipping malformed model card at %s: %s", kv_key, error)
        reason = str(error)
    else:
        log.error("skipping malformed endpoint instance at %s: %s", kv_key, error)
        reason = f"invalid endpoint instance: {error}"
    if skipped is not None:
        skipped[kv_key] = reason


def _parse_instance(kv_key: str, value: bytes) -> tuple[InstanceId, InstanceInfo]:
    """The endpoint instance stored at `kv_key`; ValueError if key or value does not fit
    (`TooDeep` if it nests deeper than `shoal.bounds.MAX_DEPTH`)."""
    ident = parse_instance_key(kv_key)
    check_json_depth(value)
    try:
        info = _instance_decoder.decode(value)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None
    endpoint, instance_id = ident
    if (info.namespace, info.component, info.endpoint, info.instance_id) != (
        endpoint.namespace,
        endpoint.component,
        endpoint.endpoint,
        instance_id,
    ):
        raise ValueError("value does not match its key")
    return ident, info


def _interned(card: ModelCard) -> ModelCard:
    """`card` with the strings its model's other cards repeat (names, source, file names and
    checksums) interned: ten thousand instances of a model hold one copy of each."""
    files = {
        sys.intern(name): msgspec.structs.replace(file, checksum=sys.intern(file.checksum))
        for name, file in card.metadata_files.items()
    }
    return msgspec.structs.replace(
        card,
        display_name=sys.intern(card.display_name),
        slug=sys.intern(card.slug),
        source=sys.intern(card.source),
        metadata_files=files,
    )


class _HeldCard(msgspec.Struct, frozen=True, gc=False):
    """A registered card and its key, with the revisions of the store value it was read
    from (held by the ten thousand: no reference cycle can go through it, so the collector
    skips it). Immutable: the readers of one `Discovery` that read the same value share it."""

    key: ModelKey
    card: ModelCard
    create_revision: int
    mod_revision: int


class CardsAndInstances:
    """The model cards and endpoint instances of one query as last read from the store, and
    the routable models (each card joined to its instance) last reported from them.

    Every reader goes through here: `Discovery.list` keeps one per query between listings,
    and each `list_and_watch` stream has its own. Store changes go in as the store reports
    them (`put`, `delete`, and `replace` for a listing or a `Resync` of a whole prefix), each
    returning the model keys whose join may have moved; `report` turns those into events.

    The rules, which make a listing, a watch and a late reader agree:
    - A card held at a key's `create_revision` changes only in its taints: a write at the
      same `create_revision` that changes anything else is ignored (counted, logged, listed
      in `skipped`), and the card held is kept. Conversely a write at a new
      `create_revision` is a new registration: what was held for the key no longer counts,
      even when the new value is malformed.
    - A malformed value is listed in `skipped`; it never replaces or removes the valid
      value held at the same `create_revision`.
    - A value is parsed once per (`create_revision`, `mod_revision`): `replace` skips a key
      read at the revisions its value is held at. A value not held (malformed, or a change
      ignored) is parsed, and reported, on every `replace` that reads it.
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
        self.cards: dict[ModelKey, _HeldCard] = {}
        self.instances: dict[InstanceId, InstanceInfo] = {}
        # The keys of `cards` by endpoint instance: an instance change touches its cards only.
        self.cards_of: dict[InstanceId, list[ModelKey]] = {}
        # (create_revision, mod_revision) of the value held at each store key, per key root.
        self.held: dict[str, dict[str, tuple[int, int]]] = {INSTANCES: {}, MODELS: {}}
        self.reported: dict[ModelKey, ModelInstance] = {}
        self._listing: list[ModelInstance] | None = None  # `reported`, in key order

    def put(
        self, kv_key: str, value: bytes, create_revision: int, mod_revision: int
    ) -> list[ModelKey]:
        """A value written at `kv_key`. A watch's `Put` does not carry the key's
        `create_revision` and passes 0: the one held (an in-place change), or `mod_revision`
        when none is held (a create's revision is its create revision)."""
        root = INSTANCES if kv_key.startswith(INSTANCES) else MODELS
        held = self.held[root].get(kv_key)
        if not create_revision:
            create_revision = mod_revision if held is None else held[0]
        touched: list[ModelKey] = []
        self._put(root, held, kv_key, value, (create_revision, mod_revision), touched)
        return touched

    def _put(
        self,
        root: str,
        held_at: tuple[int, int] | None,
        kv_key: str,
        value: bytes,
        read_at: tuple[int, int],
        touched: list[ModelKey],
    ) -> None:
        """Take `value`, read at `read_at` (create_revision, mod_revision), over the value
        held at `kv_key` (read at `held_at`); add the model keys this may move to `touched`."""
        if held_at is not None and held_at[0] != read_at[0]:
            touched.extend(self.delete(kv_key))  # a new registration at the key
        if root == INSTANCES:
            touched.extend(self._put_instance(kv_key, value, read_at))
        else:
            touched.extend(self._put_card(kv_key, value, read_at))

    def _peer(self, root: str, kv_key: str, revisions: tuple[int, int]) -> CardsAndInstances | None:
        """Another reader of the query that holds the value of `kv_key` read at `revisions`."""
        for peer in self.peers:
            if peer is not self and peer.held[root].get(kv_key) == revisions:
                return peer
        return None

    def _put_instance(
        self, kv_key: str, value: bytes, revisions: tuple[int, int]
    ) -> Iterable[ModelKey]:
        peer = self._peer(INSTANCES, kv_key, revisions)
        shared = None if peer is None else peer.instances.get(ident := parse_instance_key(kv_key))
        if peer is not None and shared is not None:
            info, revisions = shared, peer.held[INSTANCES][kv_key]
        else:
            try:
                ident, info = _parse_instance(kv_key, value)
            except ValueError as exc:
                _report_malformed("instance", kv_key, exc, self.skipped)
                return ()
        self.skipped.pop(kv_key, None)
        self.instances[ident] = info
        self.held[INSTANCES][kv_key] = revisions
        return self.cards_of.get(ident, ())

    def _put_card(
        self, kv_key: str, value: bytes, revisions: tuple[int, int]
    ) -> Iterable[ModelKey]:
        peer = self._peer(MODELS, kv_key, revisions)
        shared = None if peer is None else peer.cards.get(parse_model_key(kv_key))
        if peer is not None and shared is not None:
            key, card, revisions = shared.key, shared.card, peer.held[MODELS][kv_key]
        else:
            try:
                key = parse_model_key(kv_key)
                card = _interned(ModelCard.from_json(value))
            except (ValueError, CardError) as exc:
                _report_malformed("model", kv_key, exc, self.skipped)
                return ()
        held = self.cards.get(key)
        if held is not None and not held.card.same_except_taints(card):
            IGNORED_CHANGES.inc()
            log.warning("ignoring a change to registered card %s other than its taints", key)
            self.skipped[kv_key] = IGNORED
            return ()
        self.skipped.pop(kv_key, None)
        if held is None:  # most instances serve one card: a list is smaller than a set
            self.cards_of.setdefault((key.endpoint, key.instance_id), []).append(key)
        self.cards[key] = shared or _HeldCard(key, card, revisions[0], revisions[1])
        self.held[MODELS][kv_key] = revisions
        return (key,)

    def delete(self, kv_key: str) -> Iterable[ModelKey]:
        """`kv_key` was deleted: its value, if one is held, is gone."""
        self.skipped.pop(kv_key, None)
        if kv_key.startswith(INSTANCES):
            if self.held[INSTANCES].pop(kv_key, None) is None:
                return ()
            ident = parse_instance_key(kv_key)  # valid: its value was held
            del self.instances[ident]
            return list(self.cards_of.get(ident, ()))
        if self.held[MODELS].pop(kv_key, None) is None:
            return ()
        key = parse_model_key(kv_key)
        del self.cards[key]
        ident = (key.endpoint, key.instance_id)
        keys = self.cards_of[ident]
        keys.remove(key)
        if not keys:
            del self.cards_of[ident]
        return (key,)

    async def replace(
        self, prefix: str, items: Sequence[KeyValue], pause_every: int = LIST_BATCH
    ) -> list[ModelKey]:
        """The whole of `prefix` (a listing, or a `Resync`): every held key it lacks is gone.
        Yields to the event loop every `pause_every` values (0: never)."""
        touched: list[ModelKey] = []
        root = INSTANCES if prefix.startswith(INSTANCES) else MODELS
        held = self.held[root]
        held_before, held_seen = len(held), 0
        for i, kv in enumerate(items, 1):
            if pause_every and i % pause_every == 0:
                await asyncio.sleep(0)
            revisions = held.get(kv.key)
            if revisions is not None:
                held_seen += 1
                if revisions[1] == kv.mod_revision and revisions[0] == kv.create_revision:
                    continue  # the value held: not parsed again
            read_at = (kv.create_revision, kv.mod_revision)
            self._put(root, revisions, kv.key, kv.value, read_at, touched)
        skipped = [k for k in self.skipped if k.startswith(prefix)]
        if held_seen < held_before or skipped:  # something may be gone: find what
            seen = {kv.key for kv in items}
            for kv_key in [k for k in held if k not in seen]:
                touched.extend(self.delete(kv_key))
            for kv_key in skipped:
                if kv_key not in seen:
                    self.skipped.pop(kv_key, None)  # no longer in the store
        return touched

    async def replace_all(
        self, query: Query, items: Sequence[KeyValue], pause_every: int = LIST_BATCH
    ) -> list[ModelKey]:
        """`replace` both prefixes of `query` with `items`, read at one revision."""
        instances = [kv for kv in items if kv.key.startswith(INSTANCES)]
        models = [kv for kv in items if kv.key.startswith(MODELS)]
        touched = await self.replace(query.instances_prefix, instances, pause_every)
        return touched + await self.replace(query.models_prefix, models, pause_every)

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
        for i, key in enumerate(sorted(set(keys), key=ModelKey.sort_key), 1):
            if pause_every and i % pause_every == 0:
                await asyncio.sleep(0)
            before, now = self._rejoin(key)
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
        for i, key in enumerate(keys, 1):
            if i % LIST_BATCH == 0:
                await asyncio.sleep(0)
            self._rejoin(key)

    def _rejoin(self, key: ModelKey) -> tuple[ModelInstance | None, ModelInstance | None]:
        """Join the card at `key` to its instance again: the model reported before, and the
        one now (None: not routable), both None or the same one when it did not move."""
        before = self.reported.get(key)
        held = self.cards.get(key)
        info = None if held is None else self.instances.get((key.endpoint, key.instance_id))
        if held is None or info is None:
            if before is not None:
                del self.reported[key]
                self._listing = None
            return before, None
        if (
            before is not None
            and before.card is held.card
            and before.instance is info
            and before.revision == held.mod_revision
        ):
            return before, before
        now = None
        for peer in self.peers:  # the same model reported by another reader: shared
            if peer is not self:
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
            now = ModelInstance(held.key, held.card, info, held.mod_revision)
        self.reported[key] = now
        self._listing = None
        return before, now

    def listing(self) -> list[ModelInstance]:
        """The models reported, in key order (sorted again only after a change)."""
        if self._listing is None:
            self._listing = sorted(self.reported.values(), key=_model_order)
        return list(self._listing)


async def _paced(events: list[DiscoveryEvent]) -> AsyncIterator[DiscoveryEvent]:
    """`events`, yielding to the event loop after every `LIST_BATCH` of them."""
    for i, event in enumerate(events, 1):
        yield event
        if i % LIST_BATCH == 0:
            await asyncio.sleep(0)


def _model_order(model: ModelInstance) -> tuple[str, str, str, int, str]:
    return model.key.sort_key()


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
        # What the last complete `list` of each query read, for the next one to start from.
        self._listed: dict[Query, CardsAndInstances] = {}
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
                instances.append(_parse_instance(kv.key, kv.value)[1])
            except ValueError as exc:
                _report_malformed("instance", kv.key, exc, None)
        return instances

    async def list(
        self, query: Query | None = None, *, on_answer: Callable[[], None] | None = None
    ) -> list[ModelInstance]:
        """Routable models in scope: cards whose endpoint instance is registered.
        `on_answer` is called once the store has answered, before the values are parsed.

        Each listing starts from what the last one of the same query read (one
        `CardsAndInstances` per query): a value at the revisions it was read at is not
        parsed again, and a model that did not move is the same `ModelInstance`. Parsing
        yields to the event loop every `LIST_BATCH` values: a listing of ten thousand
        instances must not hold up the requests a frontend serves meanwhile.
        """
        query = query or Query()
        self._listing[query] = self._listing.get(query, 0) + 1
        try:
            # Taken out while it is updated: a listing that fails or is cancelled half-way,
            # or runs beside another of the same query, never leaves a half-updated join.
            join = self._listed.pop(query, None) or self._reader(query)
            async with self._listing_slots:
                snap = await self.store.get_prefixes((query.instances_prefix, query.models_prefix))
            if on_answer is not None:
                on_answer()
            touched = await join.replace_all(query, snap.items)
            await join.catch_up(touched)
            if query not in self._forgotten:
                self._listed[query] = join
            return join.listing()
        finally:
            self._listing[query] -= 1
            if not self._listing[query]:
                del self._listing[query]
                self._forgotten.discard(query)

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
        self._readers.pop(query, None)
        if query in self._listing:
            self._forgotten.add(query)

    async def list_and_watch(self, query: Query | None = None) -> AsyncIterator[DiscoveryEvent]:
        """The models in scope as `Added` events, then every change, with no gap.

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
        join = self._reader(query)
        async with self._listing_slots:
            snap = await self.store.get_prefixes(prefixes)
        # A snapshot (here, and in a `Resync`) is applied to the stream's own join, then
        # reported; both yield to the event loop every `LIST_BATCH` values or events: the
        # first listing of 20,000 models held a frontend's loop ~0.5 s. A consumer applying
        # the events meanwhile is never worse off: arrivals come before departures.
        touched = await join.replace_all(query, snap.items)
        revision = snap.revision
        # This generator lives as long as the stream: it must not keep the values it read
        # (at 30,000 instances the snapshot's bytes were a third of a frontend's memory).
        del snap
        async for event in _paced(await join.report(touched)):
            yield event
        del touched
        watch = self.store.watch_prefixes(prefixes, revision + 1)
        async with contextlib.aclosing(watch):
            async for ev in watch:
                if isinstance(ev, Resync):
                    keys = await join.replace_all(query, ev.items)
                elif isinstance(ev, Put):
                    keys = join.put(ev.key, ev.value, 0, ev.revision)
                else:
                    keys = list(join.delete(ev.key))
                del ev  # (nor the last `Resync`'s)
                async for event in _paced(await join.report(keys)):
                    yield event
