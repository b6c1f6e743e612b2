"""The model watcher: keeps the registry in step with discovery, and repairs what it misses.

Two paths change registrations, and a generation fence orders them:

- Events. `list_and_watch` streams `Added`, `Removed` and `TaintsUpdated`, one stream per
  namespace. Handling an event never blocks: a card whose metadata files are not cached yet
  is fetched in a background task and joins its worker set when the files are verified.
- Reconciliation. Every `reconcile_interval` seconds a `Reconciler` (a `shoal.controllers`
  controller) lists discovery and repairs the difference: registers what events missed,
  retries incomplete or refused registrations, removes cards that discovery no longer has.
  Its pass does not wait for the metadata fetches it starts: one worker whose files hang
  delays only its own card, never the repair of the others nor the loop's health.

Which checksum a worker set runs is elected from every card discovery holds for it
(`versions.Versions`), so frontends with different histories agree; a card of another
checksum waits, refused, and takes over when the election turns to it.

The generation fence: every change to a key, by event or by repair, takes the next value
of one counter as that key's generation. A reconciliation pass notes the counter before it
lists discovery (its epoch) and leaves alone every key whose generation is newer: an event
about it arrived after the listing, so the listing is the stale view. A metadata fetch
joins its card only if the registration it was started for is still the current one, so a
slow registration that finishes after a newer removal never resurrects it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from itertools import compress, repeat
from operator import and_, attrgetter, is_, not_
from typing import Any

from shoal.controllers import Controller, HeartbeatMixin
from shoal.discovery import (
    Added,
    Discovery,
    DiscoveryEvent,
    ModelInstance,
    ModelKey,
    Query,
    Removed,
)
from shoal.frontend.registry.freeze import FREEZE_WINDOW, freeze_bursts, freeze_while_loading
from shoal.frontend.registry.metadata import MetadataCache
from shoal.frontend.registry.metrics import FrontendMetrics
from shoal.frontend.registry.registrations import JoinLines, Registration, State
from shoal.frontend.registry.registry import Registry, SetId
from shoal.frontend.registry.scope import FollowedScope
from shoal.frontend.registry.store_state import StoreState
from shoal.frontend.registry.versions import Versions
from shoal.store import StoreError

log = logging.getLogger(__name__)

APPLY_BATCH = 64
"""Keys a reconciliation pass repairs between two yields to the event loop."""
SCAN_SLICE = 4096
"""Keys a pass goes through in one comprehension (a lookup each) between two yields."""
SETTLED_SLICE = 1024
"""Listed keys a pass checks in C loops for the common case (joined with the very card
listed) between two yields."""
START_SLICE = 64
"""Streams started between two yields to the event loop: the first step of each (its
listing's copy, its store watch) runs in the turn after it is started, and a frontend of
3,000 namespaces started them all in one (a 305 ms hold)."""
PROGRESS_INTERVAL = 5.0
"""Seconds between two log lines of the first snapshot's progress while it loads."""


_key = attrgetter("key")
_card = attrgetter("card")


def _nothing() -> None:
    pass


def _unwatched(what: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


class ModelWatcher(FollowedScope):
    """Applies discovery to the registry: events as they come, and reconciliation passes
    (and, with `follow_membership`, follows a membership's scope: `FollowedScope`)."""

    def __init__(
        self,
        discovery: Discovery,
        registry: Registry,
        cache: MetadataCache,
        metrics: FrontendMetrics,
        namespaces: Iterable[str] = (),
        *,
        follow_membership: bool = False,
        freeze_loading: bool = False,
    ) -> None:
        self.discovery = discovery
        self.freeze_loading = freeze_loading
        self.registry = registry
        self.cache = cache
        self.metrics = metrics
        self.queries = [Query(namespace=ns) for ns in namespaces] or [Query()]
        self.registrations: dict[ModelKey, Registration] = {}
        self.snapshot_loaded = asyncio.Event()
        # Set when the store answered the first listing: what a setup timeout bounds (the
        # fleet it lists then takes as long as its size needs, with `progress()` reported).
        self.store_answered = asyncio.Event()
        self.listed: int | None = None  # keys in the last listing, once it is read
        self._generations: dict[ModelKey, int] = {}
        self._clock = 0
        self.fetching = 0
        self._waiting = {}
        self._joinable = collections.deque()
        self._joiner = None
        self.no_fetches = asyncio.Event()
        self.no_fetches.set()
        self._epochs: list[int] = []  # of the listings being applied now
        self._tasks: set[asyncio.Task[None]] = set()
        # With `follow_membership` the scope starts empty and follows `follow(scopes)`.
        self.follows_membership = follow_membership
        if follow_membership:
            self.queries = []
        self._namespaces: dict[str, tuple[tuple[Query, ...], list[asyncio.Task[None]]]] = {}
        self._by_namespace = {} if follow_membership else None
        self._loading, self._joining = {}, 0
        self._wanted, self._follower = None, None
        self.scope_loaded = asyncio.Event()
        if not follow_membership:
            self.scope_loaded.set()  # (the scope is the namespaces given)
        self._resync_task: asyncio.Task[None] | None = None  # at most one resync runs
        self._resync_wanted = False  # a stream restarted since the running resync listed
        self.store = StoreState()
        self.on_store_back: Callable[[], None] = _nothing  # a store watch has it back
        self.versions: Versions[SetId, ModelKey] = Versions()  # every card, joined or not
        self.join_lines = JoinLines()
        # Counts of other changes (the route table's) whose bursts are frozen out of the
        # collector with the registry's (`freeze_bursts`).
        self.other_changes: list[Callable[[], int]] = []
        self._refused: dict[SetId, dict[ModelKey, Registration]] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the first snapshot (retrying until it works), then start the event streams
        from it. `store_answered` is set once the store answered; until the snapshot is
        loaded, a log line tells the progress every `PROGRESS_INTERVAL` seconds.

        Each stream starts from its query's listing just applied (`after_listing`): the
        fleet is listed once, not once more by every stream (at 100,000 instances a second
        listing of 200,000 keys, parsed and reported as 100,000 `Added` events that changed
        nothing), and what changed while it was applied comes first."""
        self.discovery.store.watch_listeners.append(self._watch_saw)
        reporter = self._spawn(self._report_progress(), "discovery:progress")
        quiet = self._spawn(
            self._quiet_while_loading(self.snapshot_loaded, FREEZE_WINDOW), "discovery:quiet"
        )
        if self.freeze_loading:
            self._spawn(
                freeze_while_loading(self.snapshot_loaded, self.no_fetches), "discovery:gc-freeze"
            )
        try:
            await self._resync()
        except BaseException:
            quiet.cancel()  # (a start that failed: later joins are logged as they come)
            raise
        finally:
            reporter.cancel()
        for i, query in enumerate(self.queries):
            if i and i % START_SLICE == 0:
                await asyncio.sleep(0)  # (each stream's first step runs in the next turn)
            self._spawn(self._watch(query, after_listing=True), f"watch:{query.models_prefix}")
        self.snapshot_loaded.set()
        if self.freeze_loading:
            registry, others = self.registry, self.other_changes

            def changes() -> int:
                return registry.version + sum(count() for count in others)

            self._spawn(freeze_bursts(changes), "discovery:gc-freeze-bursts")
        log.info("discovery loaded: %s", self._progress_line())

    def progress(self) -> dict[str, int | None]:
        """How far loading got: model instances listed (None until the store answered),
        registered (known to this frontend) and joined (routable, or tainted)."""
        return {
            "listed": self.listed,
            "registered": len(self.registrations),
            "joined": len(self.registry),
        }

    def _progress_line(self) -> str:
        p = self.progress()
        listed = "?" if p["listed"] is None else f"{p['listed']:,}"
        return f"{p['registered']:,} of {listed} model instances registered, {p['joined']:,} joined"

    async def _report_progress(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL)
            log.info("loading discovery: %s", self._progress_line())

    def _watch_saw(self, lost: StoreError | None) -> None:
        """A store watch lost the store, or has it back: the store's watch retries on its
        own and never raises, so without this `/health` learnt of it at the next listing."""
        if lost is None:
            self.store.answered()
            self.on_store_back()
        else:
            self.store.failed(lost)

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            self.discovery.store.watch_listeners.remove(self._watch_saw)
        tasks = list(self._tasks)
        tasks += [w.task for w in self._waiting.values() if w.task is not None]
        tasks += [self._joiner] if self._joiner is not None else []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self.join_lines.close()
        await self.cache.close()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- events ------------------------------------------------------------------------------

    async def _watch(
        self,
        query: Query,
        *,
        after_listing: bool = False,
        on_listed: Callable[[], None] | None = None,
    ) -> None:
        """Consume one `list_and_watch` stream for ever, restarting it after a failure (a
        restarted stream lists its query: `after_listing` is for the first one only).
        `on_listed` is called each time a listing of the stream has been applied."""
        backoff = 0.1
        listed = {} if on_listed is None else {"on_listed": on_listed}
        while True:
            try:
                stream = self.discovery.list_and_watch(query, after_listing=after_listing, **listed)
                after_listing = False
                async for event in stream:
                    self.handle(event)
                    backoff = 0.1
                log.warning("discovery stream of %s ended; restarting", query.models_prefix)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.store.failed(exc)
                log.warning("discovery stream of %s failed: %s", query.models_prefix, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            # Removals that happened while the stream was down come with the next listing.
            self._request_resync()

    def _request_resync(self) -> None:
        """Resync soon: one resync runs at a time, and lists again if asked to meanwhile."""
        self._resync_wanted = True
        if self._resync_task is None:
            self._resync_task = asyncio.create_task(self._resync_while_wanted(), name="resync")
            self._tasks.add(self._resync_task)
            self._resync_task.add_done_callback(self._resync_done)

    async def _resync_while_wanted(self) -> None:
        while self._resync_wanted:
            await self._resync()

    def _resync_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._resync_task is task:
            self._resync_task = None

    def handle(self, event: DiscoveryEvent) -> None:
        """Apply one discovery event. Never blocks; never raises."""
        try:
            if isinstance(event, Added):
                self._bump(event.model.key)
                self._add(event.model)
            elif isinstance(event, Removed):
                self._bump(event.key)
                self._remove(event.key)
            else:
                self._bump(event.key)
                self._set_taints(event.key, event.taints, event.revision)
        except Exception:
            log.exception("failed to apply discovery event %s", event)

    # -- reconciliation ----------------------------------------------------------------------

    async def reconcile(
        self,
        emit_heartbeat: Callable[[], None] = _nothing,
        *,
        waiting_on: Callable[[str], contextlib.AbstractContextManager[None]] = _unwatched,
        wait_for_fetches: bool = True,
    ) -> Counter[str]:
        """One pass: list discovery, repair the registry, and (`wait_for_fetches`) wait for
        the metadata fetches it started, so their cards have joined when it returns.
        The listing runs inside `waiting_on("the store")`: a store that is slow to answer or
        fail is the store's trouble, which every replica shares, not this loop's.

        If listing fails nothing is changed and the error propagates. An entry that fails to
        repair is logged and skipped. Returns the repairs made, by action.
        """
        self.metrics.reconcile_runs.inc()
        with self.metrics.reconcile_duration.time():
            epoch = self._clock
            self._epochs.append(epoch)
            try:
                try:
                    with waiting_on("the store"):
                        listed = await self._list()
                except Exception:
                    self.metrics.reconcile_failures.labels("list").inc()
                    raise
                repairs, fetches = await self._apply(listed, epoch, emit_heartbeat, repairing=True)
            finally:
                self._epochs.remove(epoch)
                self._prune_generations()
            if not wait_for_fetches:
                return repairs
            for fetch in asyncio.as_completed(fetches):
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await fetch
                emit_heartbeat()
        return repairs

    async def _resync(self) -> None:
        """List and apply without waiting for fetches; retried until the listing works."""
        backoff = 0.1
        while True:
            self._resync_wanted = False  # this listing answers every request made so far
            epoch = self._clock
            self._epochs.append(epoch)
            try:
                await self._apply(await self._list(), epoch, _nothing, repairing=False)
                return
            except Exception as exc:
                self._resync_wanted = True
                log.warning("listing discovery failed: %s; retrying in %.1fs", exc, backoff)
            finally:
                self._epochs.remove(epoch)
                self._prune_generations()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _list(self) -> list[ModelInstance]:
        """Every query's models, each once; the outcome also tells whether the store is
        reachable."""
        listings: list[list[ModelInstance]] = []
        for query in self.queries:
            try:
                listings.append(await self.discovery.list(query, on_answer=self.store_answered.set))
            except Exception as exc:
                self.store.failed(exc)
                raise
        self.store.answered()
        self.store_answered.set()  # (also with no query: nothing to wait for)
        if len(listings) == 1:
            listed = listings[0]
        else:  # (the queries of one namespace may overlap)
            unique: dict[ModelKey, ModelInstance] = {}
            for models in listings:
                for start in range(0, len(models), SCAN_SLICE):
                    unique.update({m.key: m for m in models[start : start + SCAN_SLICE]})
                    await asyncio.sleep(0)
            listed = list(unique.values())
        self.listed = len(listed)
        return listed

    async def _apply(
        self,
        listed: list[ModelInstance],
        epoch: int,
        emit_heartbeat: Callable[[], None],
        *,
        repairing: bool,
    ) -> tuple[Counter[str], list[asyncio.Task[None]]]:
        """Repair each key that no event has touched since the listing: the listed ones in
        key order (per query), then the registered ones no longer listed.

        The listed keys already joined with the very card listed are found a `SETTLED_SLICE` at a
        time in C loops; the others are checked one by one. Yields to the event loop after
        every slice and every `APPLY_BATCH` keys checked, so requests and events are served
        during a long pass; a key an event changed meanwhile is newer than the listing: skipped.
        `repairing` is False when loading a snapshot (at start, after a stream restart):
        then the changes are not counted or logged as repairs.
        """
        repairs: Counter[str] = Counter()
        fetches: list[asyncio.Task[None]] = []
        registrations = self.registrations
        registered = 0  # listed keys registered before they were repaired

        def repair(key: ModelKey, model: ModelInstance | None) -> None:
            try:
                action = self._repair(key, model)
            except Exception:
                log.exception("reconciliation of %s failed; retried next pass", key)
                self.metrics.reconcile_failures.labels("entry").inc()
                return
            if action is None:
                return
            repairs[action] += 1
            if repairing:
                self.metrics.reconcile_repairs.labels(action).inc()
                log.info("reconciliation repaired %s: %s", key, action)
            registration = registrations.get(key)
            if registration is not None and registration.task is not None:
                fetches.append(registration.task)

        checked = 0
        for start in range(0, len(listed), SETTLED_SLICE):
            chunk = listed[start : start + SETTLED_SLICE]
            todo: Iterable[ModelInstance] = chunk
            if not self.follows_membership:
                # The common case, a slice at a time in C loops: joined with the very card
                # listed (the registered model is the listed one, and so is its member's
                # card). Those need nothing, whatever their generation.
                keys = list(map(_key, chunk))
                regs = list(map(registrations.get, keys))
                settled = list(
                    map(
                        and_,
                        map(
                            and_,
                            map(is_, map(getattr, regs, repeat("model"), repeat(None)), chunk),
                            map(
                                is_,
                                map(getattr, regs, repeat("state"), repeat(None)),
                                repeat(State.JOINED),
                            ),
                        ),
                        map(
                            is_,
                            map(
                                getattr,
                                self.registry.members_of(keys),
                                repeat("card"),
                                repeat(None),
                            ),
                            map(_card, chunk),
                        ),
                    )
                )
                registered += sum(settled)
                todo = compress(chunk, map(not_, settled))
            for model in todo:
                checked += 1
                if checked % APPLY_BATCH == 0:
                    emit_heartbeat()
                    await asyncio.sleep(0)
                key = model.key
                registration = registrations.get(key)
                if registration is None:
                    if self._generations.get(key, 0) <= epoch:
                        repair(key, model)
                    registered += key in registrations
                    continue
                registered += 1
                if registration.generation > epoch:
                    continue  # changed since the listing: the listing is the stale view
                if (  # the common case, in short: joined with the very card listed
                    model is registration.model
                    and registration.state is State.JOINED
                    and (member := self.registry.member(key)) is not None
                    and member.card is model.card
                    and (not self.follows_membership or self._in_scope(key))
                ):
                    continue
                repair(key, model)
            emit_heartbeat()
            await asyncio.sleep(0)
        if registered < len(registrations):  # some registered keys were not listed
            for i, key in enumerate(await self._unlisted(listed), 1):
                if i % APPLY_BATCH == 0:
                    emit_heartbeat()
                    await asyncio.sleep(0)
                if not self._changed_since(key, epoch):
                    repair(key, None)
        emit_heartbeat()
        return repairs, fetches

    async def _unlisted(self, listed: list[ModelInstance]) -> list[ModelKey]:
        """The registered keys not in `listed`, in key order (found a slice at a time)."""
        keys: set[ModelKey] = set()
        for start in range(0, len(listed), SCAN_SLICE):
            keys.update(m.key for m in listed[start : start + SCAN_SLICE])
            await asyncio.sleep(0)
        registered = list(self.registrations)
        unlisted: list[ModelKey] = []
        for start in range(0, len(registered), SCAN_SLICE):
            unlisted.extend(k for k in registered[start : start + SCAN_SLICE] if k not in keys)
            await asyncio.sleep(0)
        return sorted(unlisted, key=ModelKey.sort_key)

    def _changed_since(self, key: ModelKey, epoch: int) -> bool:
        registration = self.registrations.get(key)
        if registration is not None:
            return registration.generation > epoch
        return self._generations.get(key, 0) > epoch

    def _repair(self, key: ModelKey, model: ModelInstance | None) -> str | None:
        """Make the registration of `key` match discovery; the action taken, or None."""
        if model is not None and self.follows_membership and not self._in_scope(key):
            model = None  # listed before its namespace left the scope: it is gone for us
        registration = self.registrations.get(key)
        if model is None:
            if registration is None:
                return None
            self._bump(key)
            self._remove(key)
            return "remove"
        if registration is None:
            self._bump(key)
            self._add(model)
            return "register"
        current = registration.model
        if model is not current and (  # (readers share a model that did not move)
            current.card != model.card
            or current.instance != model.instance
            or current.revision != model.revision
        ):
            if current.instance != model.instance or current.mdcsum != model.mdcsum:
                self._bump(key)
                self._remove(key)
                self._add(model)
                return "reregister"
            if current.card.taints != model.card.taints or current.revision != model.revision:
                self._bump(key)
                self._set_taints(key, model.card.taints, model.revision)
                return "taints"
        # Unchanged in what counts: check against the registered card, whose checksum is known.
        model = current
        if registration.state is State.PENDING and registration.task is None:
            self._bump(key)
            self._try_join(registration)
            return "retry"
        if registration.state is State.REFUSED:
            return "retry" if self._join(registration) else None
        if registration.state is State.JOINED and not self._joined_as(key, model):
            self._bump(key)
            self._join(registration)
            return "rejoin"
        return None

    def _joined_as(self, key: ModelKey, model: ModelInstance) -> bool:
        """The registry holds `key` in the worker set, and with the checksum, discovery says."""
        member = self.registry.member(key)
        if member is not None and member.card is model.card:
            return True  # joined with this very card: in the set it names, with its checksum
        ws = self.registry.worker_set(key)  # (a set's members all have its checksum)
        return (
            ws is not None
            and key in ws.members
            and ws.mdcsum == model.mdcsum
            and ws.id == SetId.of(key, model.card)
        )


class Reconciler(HeartbeatMixin, Controller):
    """The periodic reconciliation as a `shoal.controllers` controller (run by a `Loop`).

    A step that raises failed to list the store, and a step silent in its listing waits on
    the store: every replica shares it, so the loop reports either as failing, not stuck.
    The fetches a step starts run on after it: a worker whose metadata hangs never holds the
    loop up."""

    def __init__(self, watcher: ModelWatcher) -> None:
        self.watcher = watcher
        self.last_repairs: Counter[str] = Counter()

    async def step(self) -> None:
        self.last_repairs = await self.watcher.reconcile(
            self.emit_heartbeat, waiting_on=self.waiting_on, wait_for_fetches=False
        )
        await self.watcher.metrics.drop_departed_sliced()  # also when nobody scrapes /metrics
