"""`Discovery`: endpoint instances, model cards and taints, kept in the store.

A model instance is routable when both its card (`shoal/v1/models/...`) and its endpoint
instance (`shoal/v1/instances/...`, which holds the request URL) are present: discovery joins
the two, so consumers see one stream of `Added`, `Removed` and `TaintsUpdated`.

A card is immutable while it lives, except its taints: an in-place change to anything else
is logged and ignored. A key whose `create_revision` changed was deleted and created again
(a worker detached a model and attached another): that is a new registration, taken as it
is, even by a listing or a `Resync` that never saw the delete.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from prometheus_client import Counter

from shoal.cards import CardError, ModelCard
from shoal.discovery.keys import (
    INSTANCES,
    EndpointId,
    ModelKey,
    Query,
    instance_key,
    parse_instance_key,
    parse_model_key,
)
from shoal.kv import KvEndpoint
from shoal.store import Delete, KeyValue, Put, Resync, Store

log = logging.getLogger(__name__)

T = TypeVar("T")

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


class InstanceInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """An endpoint instance: where requests go (`url`) and where its status server is."""

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
"""Values `Discovery.list` parses between two yields to the event loop."""
WATCH_BUFFER = 64
"""Store events `list_and_watch` holds for a consumer that is not reading. Beyond it the
store's own watch falls behind, and its bounded backlog turns into a `Resync`."""

_instance_decoder = msgspec.json.Decoder(InstanceInfo)


_ParsedCard = tuple[ModelKey, ModelCard]
_ParsedInstance = tuple[tuple[EndpointId, int], InstanceInfo]


Skipped = dict[str, str]
"""Store keys whose value is not used, with the reason: malformed, or a change ignored."""

IGNORED = "a change other than its taints was ignored: the registered card is kept"


def _parse_card(
    kv_key: str, value: bytes, skipped: Skipped | None = None
) -> tuple[ModelKey, ModelCard] | None:
    try:
        parsed = parse_model_key(kv_key), ModelCard.from_json(value)
    except (ValueError, CardError) as exc:
        MALFORMED.labels("model").inc()
        log.error("skipping malformed model card at %s: %s", kv_key, exc)
        if skipped is not None:
            skipped[kv_key] = str(exc)
        return None
    if skipped is not None:
        skipped.pop(kv_key, None)
    return parsed


def _parse_instance(
    kv_key: str, value: bytes, skipped: Skipped | None = None
) -> tuple[tuple[EndpointId, int], InstanceInfo] | None:
    try:
        ident = parse_instance_key(kv_key)
        info = _instance_decoder.decode(value)
        endpoint = ident[0]
        if (info.namespace, info.component, info.endpoint, info.instance_id) != (
            endpoint.namespace,
            endpoint.component,
            endpoint.endpoint,
            ident[1],
        ):
            raise ValueError("value does not match its key")
    except (ValueError, msgspec.DecodeError) as exc:
        MALFORMED.labels("instance").inc()
        log.error("skipping malformed endpoint instance at %s: %s", kv_key, exc)
        if skipped is not None:
            skipped[kv_key] = f"invalid endpoint instance: {exc}"
        return None
    if skipped is not None:
        skipped.pop(kv_key, None)
    return ident, info


_Read = tuple[int, int, T]
"""A value as a listing read it: (create_revision, mod_revision, parsed value)."""


async def _parse_listing(
    items: Sequence[KeyValue],
    parse: Callable[[str, bytes], T | None],
    before: dict[str, _Read[T]],
    allowed: Callable[[T, T], bool] = lambda old, new: True,
) -> dict[str, _Read[T]]:
    """The valid values of a listing by key, with their revisions; those `before` holds at
    the same revisions are reused. Yields to the event loop every `LIST_BATCH` values.

    As watchers do, a listing keeps the last valid value of a key when a malformed one, or a
    change that `allowed` refuses, replaces it. A key created again since (a new
    `create_revision`) is a new registration: what `before` held for it no longer counts.
    """
    read: dict[str, _Read[T]] = {}
    for i, kv in enumerate(items, 1):
        if i % LIST_BATCH == 0:
            await asyncio.sleep(0)
        entry = before.get(kv.key)
        if entry is not None and entry[0] != kv.create_revision:
            entry = None
        if entry is None or entry[1] != kv.mod_revision:
            parsed = parse(kv.key, kv.value)  # a bad value is reported, on every listing
            if parsed is None:
                if entry is None:
                    continue
            elif entry is None or allowed(entry[2], parsed):
                entry = (kv.create_revision, kv.mod_revision, parsed)
        read[kv.key] = entry
    return read


def _card_change_allowed(old: _ParsedCard, new: _ParsedCard, skipped: Skipped) -> bool:
    """Cards are immutable once registered, except their taints."""
    if old[1].same_except_taints(new[1]):
        return True
    IGNORED_CHANGES.inc()
    log.warning("ignoring a change to registered card %s other than its taints", new[0])
    skipped[new[0].key] = IGNORED
    return False


def _forget_skipped(skipped: Skipped, prefix: str, items: Sequence[KeyValue]) -> None:
    """Keys under `prefix` that a listing no longer holds are no longer skipped."""
    gone = [key for key in skipped if key.startswith(prefix)]
    if gone:
        present = {kv.key for kv in items}
        for key in gone:
            if key not in present:
                del skipped[key]


def _model_order(model: ModelInstance) -> tuple[str, str, str, int, str]:
    return model.key.sort_key()


class _Joined:
    """Cards and instances as last seen, and the joined models already reported."""

    def __init__(self, skipped: Skipped) -> None:
        self.skipped = skipped
        self.cards: dict[ModelKey, ModelCard] = {}
        self.revisions: dict[ModelKey, int] = {}  # of each card in `cards`
        # The create revision of each card's key: a new one is a new registration.
        self.created: dict[ModelKey, int] = {}
        self.instances: dict[tuple[EndpointId, int], InstanceInfo] = {}
        self.reported: dict[ModelKey, ModelInstance] = {}
        # The keys of `cards` by endpoint instance: an instance change touches its cards only.
        self.cards_of: dict[tuple[EndpointId, int], set[ModelKey]] = {}

    def put_card(self, key: ModelKey, card: ModelCard, created: int, revision: int) -> None:
        """A card written at its key's `created` revision (last written at `revision`). The
        same `created` as the card held is an in-place change, of which only taints are taken."""
        old = self.cards.get(key)
        if old is not None and created == self.created[key] and not old.same_except_taints(card):
            IGNORED_CHANGES.inc()
            log.warning("ignoring a change to registered card %s other than its taints", key)
            self.skipped[key.key] = IGNORED
            return
        self.cards[key] = card
        self.revisions[key] = revision
        self.created[key] = created
        self.cards_of.setdefault((key.endpoint, key.instance_id), set()).add(key)

    def drop_card(self, key: ModelKey) -> None:
        if self.cards.pop(key, None) is None:
            return
        del self.revisions[key]
        del self.created[key]
        ident = (key.endpoint, key.instance_id)
        keys = self.cards_of[ident]
        keys.discard(key)
        if not keys:
            del self.cards_of[ident]

    def apply(
        self, kv_key: str, value: bytes | None, created: int = 0, written: int = 0
    ) -> Iterable[ModelKey]:
        """Apply one raw change; returns the model keys whose joined state may have moved.

        `created` is the create revision of the key written. A watch's `Put` passes 0 and
        its own revision as `written`: it creates a card this does not hold (a create's
        revision is its create revision), or changes the one it holds in place."""
        if kv_key.startswith(INSTANCES):
            try:
                ident = parse_instance_key(kv_key)
            except ValueError as exc:
                MALFORMED.labels("instance").inc()
                log.error("skipping malformed instance key: %s", exc)
                if value is not None:
                    self.skipped[kv_key] = f"invalid endpoint instance key: {exc}"
                return ()
            if value is None:
                self.skipped.pop(kv_key, None)
                self.instances.pop(ident, None)
            elif (parsed := _parse_instance(kv_key, value, self.skipped)) is not None:
                self.instances[ident] = parsed[1]
            return list(self.cards_of.get(ident, ()))
        if value is None:
            self.skipped.pop(kv_key, None)
            try:
                key = parse_model_key(kv_key)
            except ValueError:
                return ()
            self.drop_card(key)
            return (key,)
        if (parsed_card := _parse_card(kv_key, value, self.skipped)) is None:
            return ()
        key, card = parsed_card
        self.put_card(key, card, created or self.created.get(key, written), written)
        return (key,)

    def replace(self, prefix_root: str, items: list[KeyValue]) -> Iterable[ModelKey]:
        """A resync of one prefix: everything it does not hold is gone."""
        seen = {kv.key for kv in items}
        touched: list[ModelKey] = []
        if prefix_root == INSTANCES:
            for ident in list(self.instances):
                if instance_key(*ident) not in seen:
                    touched.extend(self.apply(instance_key(*ident), None))
        else:
            for key in list(self.cards):
                if key.key not in seen:
                    touched.extend(self.apply(key.key, None))
        for kv in items:
            touched.extend(self.apply(kv.key, kv.value, kv.create_revision, kv.mod_revision))
        return touched

    def diff(self, keys: Iterable[ModelKey]) -> list[DiscoveryEvent]:
        events: list[DiscoveryEvent] = []
        for key in sorted(set(keys), key=ModelKey.sort_key):
            card = self.cards.get(key)
            info = self.instances.get((key.endpoint, key.instance_id))
            now = (
                ModelInstance(key, card, info, self.revisions[key])
                if card is not None and info is not None
                else None
            )
            before = self.reported.get(key)
            if now is None:
                if before is not None:
                    del self.reported[key]
                    events.append(Removed(key))
                continue
            self.reported[key] = now
            if before is None:
                events.append(Added(now))
            elif before.instance != now.instance or (
                before.card is not now.card and not before.card.same_except_taints(now.card)
            ):  # a new instance, or a new registration at the key
                events.extend((Removed(key), Added(now)))
            elif before.card.taints != now.card.taints or before.revision != now.revision:
                events.append(TaintsUpdated(key, now.card.taints, now.revision))
        return events


class Discovery:
    """Register, list and watch endpoint instances and model cards in a store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # What the last `list` of each prefix read: values by key, with their mod_revision.
        self._instances_read: dict[str, dict[str, _Read[_ParsedInstance]]] = {}
        self._cards_read: dict[str, dict[str, _Read[_ParsedCard]]] = {}
        self._joined: dict[str, dict[ModelKey, ModelInstance]] = {}
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
        parsed = (_parse_instance(kv.key, kv.value) for kv in snap.items)
        return [p[1] for p in parsed if p is not None]

    async def list(self, query: Query | None = None) -> list[ModelInstance]:
        """Routable models in scope: cards whose endpoint instance is registered.

        A value whose key has the mod_revision the last listing of its prefix saw is the same
        value: it is not parsed again. Parsing yields to the event loop every `LIST_BATCH`
        values: a listing of ten thousand instances must not hold up the requests a frontend
        serves meanwhile.
        """
        query = query or Query()
        inst = await self.store.get_prefix(query.instances_prefix)
        models = await self.store.get_prefix(query.models_prefix)
        skipped = self.skipped
        _forget_skipped(skipped, query.instances_prefix, inst.items)
        _forget_skipped(skipped, query.models_prefix, models.items)
        read_instances = await _parse_listing(
            inst.items,
            functools.partial(_parse_instance, skipped=skipped),
            self._instances_read.get(query.instances_prefix, {}),
        )
        self._instances_read[query.instances_prefix] = read_instances
        read_cards = await _parse_listing(
            models.items,
            functools.partial(_parse_card, skipped=skipped),
            self._cards_read.get(query.models_prefix, {}),
            functools.partial(_card_change_allowed, skipped=skipped),
        )
        self._cards_read[query.models_prefix] = read_cards
        instances = dict(parsed for _, _, parsed in read_instances.values())
        before = self._joined.get(query.models_prefix, {})
        joined: dict[ModelKey, ModelInstance] = {}
        for i, (_, revision, (key, card)) in enumerate(read_cards.values(), 1):
            if i % LIST_BATCH == 0:
                await asyncio.sleep(0)
            info = instances.get((key.endpoint, key.instance_id))
            if info is None:
                continue
            model = before.get(key)
            if model is None or model.card is not card or model.instance is not info:
                model = ModelInstance(key, card, info, revision)
            joined[key] = model
        self._joined[query.models_prefix] = joined
        return sorted(joined.values(), key=_model_order)

    async def list_and_watch(self, query: Query | None = None) -> AsyncIterator[DiscoveryEvent]:
        """The models in scope as `Added` events, then every change, with no gap.

        Each prefix is read, then watched from the read's revision + 1. A store `Resync`
        (after a lost connection, or for a consumer that fell behind) becomes the events
        that bring the consumer up to date. The stream ends when the store is closed, and
        raises what a store watch raised.
        """
        query = query or Query()
        joined = _Joined(self.skipped)
        inst = await self.store.get_prefix(query.instances_prefix)
        models = await self.store.get_prefix(query.models_prefix)
        prefixes = {INSTANCES: query.instances_prefix, "": query.models_prefix}
        _forget_skipped(self.skipped, query.instances_prefix, inst.items)
        _forget_skipped(self.skipped, query.models_prefix, models.items)
        touched = [*joined.replace(INSTANCES, inst.items), *joined.replace("", models.items)]
        for event in joined.diff(touched):
            yield event

        # Bounded: a consumer that does not read holds back the store's watches, whose own
        # bounded backlog then turns into a `Resync` (no unbounded copy here).
        # None: a store watch ended, because the store was closed.
        queue: asyncio.Queue[tuple[str, Put | Delete | Resync] | Exception | None] = asyncio.Queue(
            WATCH_BUFFER
        )

        async def pump(root: str, prefix: str, start: int) -> None:
            try:
                async for ev in self.store.watch(prefix, start):
                    await queue.put((root, ev))
                await queue.put(None)
            except Exception as exc:
                await queue.put(exc)

        tasks = [
            asyncio.create_task(pump(INSTANCES, query.instances_prefix, inst.revision + 1)),
            asyncio.create_task(pump("", query.models_prefix, models.revision + 1)),
        ]
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                root, ev = item
                if isinstance(ev, Resync):
                    _forget_skipped(self.skipped, prefixes[root], ev.items)
                    keys = list(joined.replace(root, ev.items))
                elif isinstance(ev, Put):
                    keys = list(joined.apply(ev.key, ev.value, written=ev.revision))
                else:
                    keys = list(joined.apply(ev.key, None))
                for event in joined.diff(keys):
                    yield event
        finally:
            for task in tasks:
                task.cancel()
            # What the pumps raise is theirs; a cancel of this task while waiting propagates.
            await asyncio.gather(*tasks, return_exceptions=True)
