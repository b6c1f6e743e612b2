"""`Registrations`: what a worker process announces in discovery, all under its one lease.

Endpoints register their instances and attach their models here; nothing else writes a
worker's keys. Every key is put under the process lease, whose id is the instance id, and
each model's metadata files are hosted under its registration key (`ModelKey`), so a lost
lease is repaired in one place: a new lease, then every key put again under its id.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import operator
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import msgspec

from shoal.cards import ModelCard
from shoal.discovery import Discovery, EndpointId, InstanceInfo, ModelKey
from shoal.discovery.keys import instance_key
from shoal.kv import KvEndpoint
from shoal.store import Lease, LeaseKeeper, LeaseNotFoundError, Store, StoreError
from shoal.store.base import check_key, check_value
from shoal.worker.engine import ServedModel
from shoal.worker.metadata import CollisionError, MetadataKey, MetadataRegistry

log = logging.getLogger(__name__)
_KEY = operator.attrgetter("key")

DRAINING = "draining"
"""The taint every model of a draining process carries: frontends stop picking it."""

READ_CHUNK = 64
"""Endpoints whose keys one read lists (two prefixes each: etcd refuses a transaction of
more than 128 operations by default)."""

KEYS_PER_TURN = 1024
"""Keys a lease-loop turn compares with its listing of the store between two yields to the
event loop, freeing the listing as they go: a worker with 20,000 adapters compared and freed
them all in one turn every TTL/3 (6.4 ms of the loop thread's CPU; 1.6 ms now)."""

PUT_BATCH = 1024
"""Cards a re-registration under a new lease puts in one `Store.put_many`, made ready
(each card's JSON, its files moved to its new key: ~2 ms for 1,024) in one turn of the event
loop. One store call (and SQLite transaction) per card took 8-27 s for 20,000."""

MISSING_NAMED = 3
"""Keys missing from the store that a warning and `lease_problem()` name (then a count)."""

STORE_ERRORS = (StoreError, OSError, TimeoutError)
"""What a store call raises when the store is unreachable or refuses: retried, not fatal."""


Entry = tuple[ModelCard, str | None, Mapping[str, bytes], ServedModel | None]
"""A model to attach: its card, suffix, metadata files and the engine's model (if any)."""


@dataclass
class Attached:
    """A model attached to an endpoint: its current registration key, card and hosted files.

    `card` is the card as it should be announced; `stored` is the card last given to the
    store at `key` (None: not yet, or not known). `set_taints` puts only the cards whose
    `stored` is not `card`, so a try cut short is continued, not started again."""

    key: ModelKey
    card: ModelCard
    files: dict[str, bytes]  # the metadata files as registered (what the card's checksums say)
    served: ServedModel | None = None  # set when the model came from the engine
    stored: ModelCard | None = None


class Registrations:
    """The endpoint instances and models one process announces, and the lease they are under.

    `lease` is the lease the keeper holds now; `lease_id` is the lease every registration
    here was put under. When they are equal, every instance and model held here is in the
    store under `lease_id` and each model's metadata files are owned by its key under that
    id. When the lease is lost and replaced, the new lease's grant re-puts every registered
    instance and its models (each card as it is now, taints included, `PUT_BATCH` cards per
    `Store.put_many`), moves their metadata
    files to the new keys and only then sets `lease_id` to the new id; until then
    `lease_problem()` says so, and `renew()` retries it. Withdrawals that failed are retried
    while their lease is current and forgotten once it is replaced (their keys went with it).
    Each `renew()` also lists the keys held here (one read) and puts back one the store lost
    (deleted by someone else): logged, counted in `repairs`, and in `lease_problem()` until put back.

    Writes are serialised by one lock, so a re-registration never interleaves with an
    attach or a detach. While `draining` is set, every card put carries the `DRAINING` taint.
    """

    def __init__(
        self,
        store: Store,
        metadata: MetadataRegistry,
        *,
        lease_ttl: float,
        draining: asyncio.Event,
    ) -> None:
        self.store = store
        self.discovery = Discovery(store)
        self.metadata = metadata
        self.draining = draining
        self.renew_error: str | None = None
        """Why the last `renew()` failed (the store was unreachable); None once one succeeds."""
        self._keeper = LeaseKeeper(store, lease_ttl, self._on_granted)
        self._lease_id: int | None = None
        self._instances: dict[EndpointId, InstanceInfo] = {}  # as last put
        self._models: dict[EndpointId, dict[str | None, Attached]] = {}
        self.models_changed = 0
        """Changes to the models attached (one more at each attach, detach or forget): what
        is derived from them stays current while this count does."""
        self._pending_deletes: dict[str, int] = {}  # key -> lease it was put under
        self.missing: set[str] = set()
        """Keys of ours found missing from the store and not put back yet."""
        self.repairs = 0
        """Keys of ours found missing from the store (deleted by someone else) and put back."""
        self._lock = asyncio.Lock()

    # -- the lease ----------------------------------------------------------------------

    async def start(self) -> None:
        """Grant the first lease; raises `StoreUnavailableError` if the store is unreachable."""
        await self._keeper.start()

    @property
    def lease(self) -> Lease | None:
        """The lease held now (None before `start()`)."""
        return self._keeper.lease

    @property
    def lease_id(self) -> int | None:
        """The id of the lease every registration here was put under (None before `start()`)."""
        return self._lease_id

    @property
    def instance_id(self) -> int:
        """The id of the lease held now: the instance id every new registration gets."""
        if self._keeper.lease is None:
            raise RuntimeError("the runtime is not started")
        return self._keeper.lease.id

    @property
    def grants(self) -> int:
        """Leases granted so far (more than 1: the lease was lost and replaced)."""
        return self._keeper.grants

    @property
    def renew_interval(self) -> float:
        """Seconds between two `renew()` calls: a third of the lease TTL."""
        return self._keeper.interval

    async def renew(self) -> None:
        """One turn of the lease loop: renew the lease (or replace a lost one), then finish a
        pending re-registration and retry failed withdrawals.

        A store error is not raised: it is logged once, kept in `renew_error` (it shows in
        `lease_problem()`) and retried on the next turn; the process serves on meanwhile.
        """
        try:
            await self._keeper.tick()
            await self._reconcile()
        except STORE_ERRORS as exc:
            if self.renew_error is None:
                log.warning("store unreachable: %s (serving on; will re-register)", exc)
            self.renew_error = str(exc) or type(exc).__name__
            return
        if self.renew_error is not None:
            log.info("store reachable again; lease %x held", self.instance_id)
        self.renew_error = None

    def lease_problem(self) -> str | None:
        """Why the lease is not held with everything registered under it, or None."""
        lease = self._keeper.lease
        if lease is None:
            return "no lease"
        error = f": {self.renew_error}" if self.renew_error else ""
        if not self._keeper.held:
            return f"lease {lease.id:x} lost{error}"
        silence = time.monotonic() - lease.last_renewed
        if silence > self._keeper.ttl:
            return f"lease {lease.id:x} not renewed for {silence:.1f}s{error}"
        if self._lease_id != lease.id:
            return f"registering under the new lease {lease.id:x}"
        if self.missing:
            missing = self.missing
            named = ", ".join(heapq.nsmallest(MISSING_NAMED, missing))
            more = (
                f" and {len(missing) - MISSING_NAMED:,} more"
                if len(missing) > MISSING_NAMED
                else ""
            )
            return f"registrations missing from the store: {named}{more}"
        return None

    async def revoke(self) -> None:
        """Revoke the lease: the store deletes every key still under it."""
        await self._keeper.revoke()

    async def retire_replaced(self) -> None:
        """End the leases the current one replaced now (a drain: their copies of this
        process's registrations would stay untainted until they expire)."""
        await self._keeper.retire_now()

    async def _on_granted(self, lease: Lease) -> None:
        """A new lease: re-register everything this process owns under its id."""
        old = self._lease_id
        if old is not None and old != lease.id:
            log.warning("lease %x replaced by %x: re-registering", old, lease.id)
        await self._register_all(lease)

    async def _register_all(self, lease: Lease) -> None:
        async with self._lock:
            old = self._lease_id
            if old is not None and old != lease.id:
                # Withdrawals pending under the old lease go with it. The old lease itself is
                # revoked by the keeper only after this re-put: frontends see the new keys
                # before the old ones go, never a moment with neither.
                self._pending_deletes.clear()
            for endpoint, info in list(self._instances.items()):
                info = msgspec.structs.replace(info, instance_id=lease.id)
                await self.discovery.register_instance(info, lease=lease.id)
                self._instances[endpoint] = info
                models = list(self._models.get(endpoint, {}).items())
                for start in range(0, len(models), PUT_BATCH):
                    cards: list[tuple[str, bytes]] = []
                    batch = models[start : start + PUT_BATCH]
                    for suffix, att in batch:
                        key = ModelKey(endpoint, lease.id, suffix)
                        self.metadata.reassign(att.key, key)
                        att.key, att.stored = key, None
                        cards.append((key.key, att.card.to_json()))
                    await self._put_cards(cards, lease.id)
                    for _, att in batch:
                        att.stored = att.card
                    await asyncio.sleep(0)  # (a batch a turn, whatever the store)
            self._lease_id = lease.id
            self.missing.clear()  # every key was just put

    async def _put_cards(self, cards: list[tuple[str, bytes]], lease_id: int) -> None:
        """Put `cards` (key, JSON) in one `put_many`. One the store would refuse (a value
        over its bound) is logged and left out; the others are put."""
        fit: list[tuple[str, bytes]] = []
        for key, data in cards:
            try:
                check_key(key)
                check_value(key, data)
            except ValueError as exc:
                log.error("registration %s not put again: %s", key, exc)
                continue
            fit.append((key, data))
        await self.store.put_many(fit, lease=lease_id)

    async def _reconcile(self) -> None:
        """After a successful renewal: finish a re-registration, retry failed withdrawals."""
        lease = self._keeper.lease
        assert lease is not None
        if self._lease_id != lease.id:
            await self._register_all(lease)
        else:
            await self._put_back_missing(lease.id)
        if self._pending_deletes:
            async with self._lock:
                pending = self._pending_deletes
                due = [key for key, lease_id in pending.items() if lease_id == lease.id]
                for key in [key for key, lease_id in pending.items() if lease_id != lease.id]:
                    del pending[key]  # (gone with the lease they were put under)
                for start in range(0, len(due), PUT_BATCH):
                    batch = due[start : start + PUT_BATCH]
                    await self.store.delete_many(batch)
                    for key in batch:
                        pending.pop(key, None)

    async def _put_back_missing(self, lease_id: int) -> None:
        """Put back every key of ours the store no longer holds (someone deleted it, or a
        store restored from a backup lost it). The keys are read in one listing of the
        instance's keys per `READ_CHUNK` endpoints, not one read per key: a worker with
        hundreds of adapters must not spend a round trip per model each lease-loop turn,
        holding the lock and delaying the next keepalive. The listing and the keys are
        compared `KEYS_PER_TURN` at a time, yielding to the event loop between."""
        async with self._lock:
            if self._lease_id != lease_id:
                return
            endpoints = list(self._instances.items())
            present: set[str] = set()
            for i in range(0, len(endpoints), READ_CHUNK):
                prefixes = [
                    p
                    for endpoint, _ in endpoints[i : i + READ_CHUNK]
                    for p in (
                        instance_key(endpoint, lease_id),
                        ModelKey(endpoint, lease_id, None).key,
                    )
                ]
                items = list((await self.store.get_prefixes(prefixes)).items)
                while items:  # (and freed a slice at a time: 20,000 cards at once took ~4 ms)
                    present.update(map(_KEY, items[:KEYS_PER_TURN]))
                    del items[:KEYS_PER_TURN]
                    await asyncio.sleep(0)
            instances: list[tuple[str, InstanceInfo]] = []
            cards: list[tuple[Attached, ModelCard]] = []
            checked = 0
            for endpoint, info in endpoints:
                key = instance_key(endpoint, lease_id)
                if self._is_missing(key, present):
                    instances.append((key, info))
                for att in list(self._models.get(endpoint, {}).values()):
                    checked += 1
                    if checked % KEYS_PER_TURN == 0:
                        await asyncio.sleep(0)
                    if self._is_missing(att.key.key, present):
                        cards.append((att, att.card))
            if instances or cards:
                await self._put_back(lease_id, instances, cards)

    async def _put_back(
        self,
        lease_id: int,
        instances: list[tuple[str, InstanceInfo]],
        cards: list[tuple[Attached, ModelCard]],
    ) -> None:
        """Put back what the store lost: the instances, then the cards `PUT_BATCH` per
        `Store.put_many`, one batch a turn, with the lease kept alive meanwhile (8,000 cards
        put back a store call each outlived a 5 s TTL, and the whole worker left discovery).
        Logged once, counted in `repairs`; in `missing` until put back."""
        keys = [key for key, _ in instances] + [att.key.key for att, _ in cards]
        self.missing.update(keys)
        shown = ", ".join(heapq.nsmallest(MISSING_NAMED, keys))
        log.warning(
            "%d registrations missing from the store (%s%s): putting them back",
            len(keys),
            shown,
            ", ..." if len(keys) > MISSING_NAMED else "",
        )
        lease = self._keeper.lease
        if lease is not None:
            lease.start_keepalive()
        try:
            for key, info in instances:
                await self.discovery.register_instance(info, lease=lease_id)
                self._repaired([key])
            for start in range(0, len(cards), PUT_BATCH):
                batch = cards[start : start + PUT_BATCH]
                await self._put_cards([(a.key.key, card.to_json()) for a, card in batch], lease_id)
                for att, card in batch:
                    att.stored = card
                self._repaired([att.key.key for att, _ in batch])
                await asyncio.sleep(0)
        finally:
            if lease is not None:
                lease.stop_keepalive()

    @staticmethod
    def _is_missing(key: str, present: set[str]) -> bool:
        return key not in present

    def _repaired(self, keys: list[str]) -> None:
        self.missing.difference_update(keys)
        self.repairs += len(keys)

    # -- instances ----------------------------------------------------------------------

    async def register_instance(
        self,
        endpoint: EndpointId,
        url: str,
        status_url: str,
        *,
        kv_events: KvEndpoint | None = None,
    ) -> None:
        """Announce `endpoint`'s instance (requests go to `url`; its KV events, if it
        publishes them, at `kv_events`) under the lease.

        If a re-registration is pending, the instance is put by it instead, under the new id.
        A put the store refuses is raised, and made by `renew()` once the store answers (the
        instance is held here from the start, in `missing` until then).
        """
        async with self._lock:
            info = InstanceInfo(
                namespace=endpoint.namespace,
                component=endpoint.component,
                endpoint=endpoint.endpoint,
                instance_id=self.instance_id,
                url=url,
                status_url=status_url,
                kv_events=kv_events,
            )
            self._instances[endpoint] = info  # (first: a put the store refuses is put back)
            if self._lease_id == info.instance_id:
                try:
                    await self.discovery.register_instance(info, lease=info.instance_id)
                except STORE_ERRORS:
                    self.missing.add(instance_key(endpoint, info.instance_id))
                    raise

    async def unregister_instance(self, endpoint: EndpointId) -> None:
        """Withdraw `endpoint`'s instance; it is no longer re-registered after a lease loss."""
        async with self._lock:
            self._instances.pop(endpoint, None)
            self.missing.discard(instance_key(endpoint, self.instance_id))
            await self.discovery.unregister_instance(endpoint, self.instance_id)

    # -- models -------------------------------------------------------------------------

    def models_of(self, endpoint: EndpointId) -> Mapping[str | None, Attached]:
        """A live, read-only view of the models attached to `endpoint`, by suffix."""
        return MappingProxyType(self._models.setdefault(endpoint, {}))

    async def attach(
        self,
        endpoint: EndpointId,
        card: ModelCard,
        suffix: str | None,
        files: Mapping[str, bytes],
        served: ServedModel | None = None,
    ) -> None:
        """Host `files` for the model, then put its card under the lease (files first: the
        card points at them). If the store refuses, the files hosted before are restored and
        nothing new stays attached; a key that held no attached card becomes a withdrawal
        pending (the put may have been made), as in `attach_many`."""
        async with self._lock:
            lease_id = self.instance_id
            key = ModelKey(endpoint, lease_id, suffix)
            models = self._models.setdefault(endpoint, {})
            previous = models.get(suffix)
            if previous is not None:
                self.metadata.reassign(previous.key, key)
            before = self.metadata.files_of(key)
            if self.draining.is_set():
                card = card.with_taints([*card.taints, DRAINING])
            slug = card.slug
            entries = [(MetadataKey.of(endpoint, slug, suffix, n), d) for n, d in files.items()]
            self.metadata.replace(key, entries)
            pending = self._pending_deletes.pop(key.key, None)
            try:
                await self.discovery.register_model(key, card, lease=lease_id)
            except BaseException:
                self.metadata.replace(key, before)
                if previous is None or pending is not None:  # (its key holds no live card)
                    # The put may have been made (its answer lost): withdrawn by `renew()`.
                    self._pending_deletes[key.key] = lease_id
                raise
            models[suffix] = Attached(key, card, dict(files), served, stored=card)
            self.models_changed += 1

    async def attach_many(
        self, endpoint: EndpointId, entries: Sequence[Entry]
    ) -> tuple[dict[str | None, Exception], set[str | None]]:
        """`attach` of each entry (card, suffix, files, served), whose suffixes are distinct
        and not attached: the cards in one `Store.put_many` (give at most `PUT_BATCH`; a
        worker's first 20,000 adapters were a store call and a SQLite transaction each).

        Returns the suffixes refused, each alone, with why (its key or card refused by the
        store's bounds), and those left for `attach` one at a time (a withdrawal of that key
        is pending: it may hold another model, which `attach` refuses). The others are
        attached. If the store fails, the files hosted before are restored, nothing of
        `entries` is attached, and the error is raised. The cards of the slices written
        before it are not known: every key of the call becomes a withdrawal pending, which
        `renew()` makes (a retry before it attaches each model `alone`)."""
        refused: dict[str | None, Exception] = {}
        alone: set[str | None] = set()
        ready: list[tuple[ModelKey, Entry, bytes, list[tuple[MetadataKey, bytes]]]] = []
        async with self._lock:
            lease_id = self.instance_id
            models = self._models.setdefault(endpoint, {})
            for card, suffix, files, served in entries:
                key = ModelKey(endpoint, lease_id, suffix)
                if suffix in models or key.key in self._pending_deletes:
                    alone.add(suffix)
                    continue
                if self.draining.is_set():
                    card = card.with_taints([*card.taints, DRAINING])
                data = card.to_json()
                before = self.metadata.files_of(key)
                slug = card.slug
                hosted = [(MetadataKey.of(endpoint, slug, suffix, n), d) for n, d in files.items()]
                try:
                    check_key(key.key)
                    check_value(key.key, data)
                    self.metadata.replace(key, hosted)
                except (ValueError, CollisionError) as exc:
                    refused[suffix] = exc
                    continue
                ready.append((key, (card, suffix, files, served), data, before))
            try:
                items = [(key.key, data) for key, _, data, _ in ready]
                await self.store.put_many(items, lease=lease_id)
            except BaseException:
                for key, _, _, before in ready:
                    self.metadata.replace(key, before)
                    self._pending_deletes[key.key] = lease_id
                raise
            for key, (card, suffix, files, served), _, _ in ready:
                models[suffix] = Attached(key, card, dict(files), served, stored=card)
            self.models_changed += len(ready)
        return refused, alone

    async def detach(self, endpoint: EndpointId, suffix: str | None) -> None:
        """Withdraw the model at `suffix` from discovery, then stop hosting its files.

        A withdrawal the store refuses is retried by `renew()` while its lease is current.
        """
        async with self._lock:
            att = self._models.get(endpoint, {}).pop(suffix, None)
            if att is None:
                return
            self.models_changed += 1
            self.missing.discard(att.key.key)
            try:
                await self.discovery.unregister_model(att.key)
            except STORE_ERRORS as exc:
                # The key vanishes with its lease if that is lost; else `renew()` retries.
                log.warning("withdrawing %s failed (will retry): %s", att.key, exc)
                self._pending_deletes[att.key.key] = att.key.instance_id
            finally:
                self.metadata.unregister_for_owner(att.key)

    async def detach_many(self, endpoint: EndpointId, suffixes: Sequence[str | None]) -> None:
        """`detach` of each of `suffixes` (give at most `PUT_BATCH`): their cards withdrawn
        in one `Store.delete_many`, then their files (one call each withdrew 20,000 adapters in
        5.0 s on SQLite, the rest announced and routed to meanwhile; 1.3 s so). A withdrawal the store refuses
        is retried by `renew()`, every key of the call (which were deleted is not known)."""
        async with self._lock:
            models = self._models.get(endpoint, {})
            gone = [att for suffix in suffixes if (att := models.pop(suffix, None)) is not None]
            if not gone:
                return
            self.models_changed += len(gone)
            self.missing.difference_update(att.key.key for att in gone)
            try:
                await self.store.delete_many([att.key.key for att in gone])
            except STORE_ERRORS as exc:
                # The keys vanish with their lease if that is lost; else `renew()` retries.
                log.warning("withdrawing %d models failed (will retry): %s", len(gone), exc)
                self._pending_deletes.update((att.key.key, att.key.instance_id) for att in gone)
            finally:
                for att in gone:
                    self.metadata.unregister_for_owner(att.key)

    async def set_taints(self, endpoint: EndpointId, taints: list[str]) -> None:
        """Replace the taints of every model attached to `endpoint`: a put of each card as
        registered, under the lease it was put under, `PUT_BATCH` per `Store.put_many` (a
        card of a lease being replaced is put with its taints by the re-registration).

        Only the cards not yet given to the store with these taints are put: a try cut short
        (a drain gives it 1.5 s, then 1 s per retry; SQLite writes ~10,000 keys/s) is
        continued by the next from where it stopped, never started again from the first."""
        wanted = tuple(sorted(set(taints)))
        async with self._lock:
            models = list(self._models.get(endpoint, {}).values())
            lost = False
            for start in range(0, len(models), PUT_BATCH):
                batch: list[Attached] = []
                for att in models[start : start + PUT_BATCH]:
                    if att.card.taints != wanted:
                        att.card = att.card.with_taints(wanted)
                    if att.stored is not att.card and att.key.instance_id == self._lease_id:
                        batch.append(att)
                if batch and not lost and self._lease_id is not None:
                    cards = [(att.key.key, att.card.to_json()) for att in batch]
                    try:
                        await self._put_cards(cards, self._lease_id)
                    except LeaseNotFoundError:  # lost: re-put with its taints
                        lost = True
                    else:
                        for att in batch:
                            att.stored = att.card
                await asyncio.sleep(0)

    def forget(self, endpoint: EndpointId) -> None:
        """Forget `endpoint`'s instance and models and stop hosting their metadata files,
        with no store call: their keys went with the revoked lease (a drain)."""
        self._instances.pop(endpoint, None)
        models = self._models.get(endpoint, {})
        for att in models.values():
            self.metadata.unregister_for_owner(att.key)
            self.missing.discard(att.key.key)
        models.clear()  # (in place: `models_of` gave a view of it)
        self.models_changed += 1
