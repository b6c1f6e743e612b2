"""`MembershipWatch`: follow a source's selections and publish the endpoints in force.

The loop, in one place (`_run`): wait for a wake-up (an event, a new selection) or the
retry tick; let a burst settle for one coalescing window; then apply the desired selection,
reopen watches that ended, read a snapshot of each scope marked dirty (or of every scope at
a full reconciliation), and publish the view if it changed.

The invariants, both ways:
- Watch before list: a scope's watch starts at the store revision read before its snapshot,
  so whatever the snapshot misses the watch delivers, and an instance that left while the
  watch opened is not in the first view.
- Epochs: every watch opened gets a new epoch; events of a watch whose scope now has another
  epoch (it was replaced or closed) are ignored. A scope that stays selected keeps its watch,
  its epoch and its endpoints' generations.
- A source error changes nothing in force; only a valid selection (even an empty one) does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable

from shoal.cards import CardError, ModelCard
from shoal.discovery import Discovery, EndpointId, ModelInstance, ModelKey, Query
from shoal.discovery.keys import MODELS, parse_model_key
from shoal.membership.discovery_source import EndpointPrefix
from shoal.membership.errors import MembershipError, SourceError
from shoal.membership.feed import Change, DiscoveryFeed, ScopeWatch
from shoal.membership.selection import Selection, Source
from shoal.membership.view import EMPTY, EndpointRef, EndpointView, Membership, MembershipStatus
from shoal.store import Put

log = logging.getLogger(__name__)

COALESCE_SECONDS = 0.05
RETRY_TICK_SECONDS = 1.0
RECONCILE_SECONDS = 30.0
SETUP_TIMEOUT_SECONDS = 10.0


@dataclasses.dataclass(eq=False)
class _Scope:
    """One watched scope (a namespace, or everything when `name` is None)."""

    name: str | None
    query: Query
    epoch: int = 0
    task: asyncio.Task[None] | None = None  # consumes the open watch; None: closed, reopen
    ready: bool = False  # a snapshot was read since the watch opened
    dirty: bool = False
    reading: bool = False
    models: dict[ModelKey, ModelInstance] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return "all namespaces" if self.name is None else f"namespace {self.name!r}"


class MembershipWatch:
    """Turns a source's selections into a published `Membership` view and a status."""

    def __init__(
        self,
        discovery: Discovery,
        source: Source,
        *,
        endpoint_prefixes: Iterable[str | EndpointPrefix] = (),
        feed: DiscoveryFeed | None = None,
        coalesce: float = COALESCE_SECONDS,
        retry_tick: float = RETRY_TICK_SECONDS,
        reconcile_interval: float = RECONCILE_SECONDS,
        setup_timeout: float = SETUP_TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.feed = feed or DiscoveryFeed(discovery)
        self.source = source
        self.endpoint_prefixes = tuple(
            p if isinstance(p, EndpointPrefix) else EndpointPrefix.parse(p)
            for p in endpoint_prefixes
        )
        self.coalesce = coalesce
        self.retry_tick = retry_tick
        self.reconcile_interval = reconcile_interval
        self.setup_timeout = setup_timeout
        self.clock = clock
        self.status = MembershipStatus()
        self.view: Membership = EMPTY
        self._scopes: dict[str | None, _Scope] = {}
        self._epochs = itertools.count(1)
        self._generations = itertools.count(1)
        self._endpoint_generations: dict[EndpointRef, EndpointView] = {}
        self._desired: Selection | None = None
        self._target: Selection | None = None  # being applied, not all scopes ready yet
        self._applied: Selection | None = None
        self._wake = asyncio.Event()
        self._first_applied = asyncio.Event()
        self._subscribers: list[Callable[[Membership], None]] = []
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def subscribe(self, callback: Callable[[Membership], None]) -> None:
        """Call `callback` with each view that differs from the last one sent."""
        self._subscribers.append(callback)

    async def start(self) -> None:
        """Follow the source; returns once its first selection is in force (bounded)."""
        self._tasks = [
            asyncio.create_task(self._follow_source(), name="membership-source"),
            asyncio.create_task(self._run(), name="membership-watch"),
        ]
        try:
            async with asyncio.timeout(self.setup_timeout):
                await self._first_applied.wait()
        except TimeoutError:
            await self.stop()
            reason = self.status.last_error or "the source offered no valid selection"
            raise MembershipError(
                f"namespace membership not set up within {self.setup_timeout:g}s: {reason}"
            ) from None

    async def stop(self) -> None:
        tasks = [*self._tasks, *(s.task for s in self._scopes.values() if s.task)]
        self._tasks = []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    def epochs(self) -> dict[str | None, int]:
        """The epoch of each scope's open watch, by namespace (None: all)."""
        return {name: scope.epoch for name, scope in self._scopes.items()}

    # -- the source --------------------------------------------------------------------------

    async def _follow_source(self) -> None:
        while True:
            try:
                async for item in self.source.selections():
                    if isinstance(item, SourceError):
                        self._fail("source", str(item))
                    else:
                        self._clear("source")
                        self._desired = item
                        self.status.desired_revision = item.revision
                    self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._fail("source", f"namespace source failed: {exc}")
            await asyncio.sleep(self.retry_tick)

    # -- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        next_full = self.clock() + self.reconcile_interval
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.retry_tick):
                    await self._wake.wait()
            if self._wake.is_set() and any(s.dirty for s in self._scopes.values()):
                await asyncio.sleep(self.coalesce)  # one window: the burst becomes one read
            self._wake.clear()
            full = self.clock() >= next_full
            if full:
                next_full = self.clock() + self.reconcile_interval
            try:
                await self._step(full)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug, not a store failure: keep what is in force
                log.exception("membership step failed")
                self._fail("step", f"membership step failed: {exc}")

    async def _step(self, full: bool) -> None:
        desired = self._desired
        if desired is not None and desired is not self._target and desired is not self._applied:
            self._select(desired)
        scopes = list(self._scopes.values())
        await asyncio.gather(*(self._open(s) for s in scopes if s.task is None))
        await asyncio.gather(
            *(self._read(s) for s in scopes if s.task is not None and (full or s.dirty))
        )
        target = self._target
        if target is not None and all(s.ready for s in self._scopes.values()):
            self._target, self._applied = None, target
            self.status.applied_revision = target.revision
            self._first_applied.set()
        self._publish()

    def _select(self, selection: Selection) -> None:
        """Close the scopes the selection dropped; add the new ones (opened by the step)."""
        wanted: dict[str | None, Query] = (
            {None: Query()}
            if selection.watch_all
            else {ns: Query(namespace=ns) for ns in sorted(selection.namespaces)}
        )
        for name in [n for n in self._scopes if n not in wanted]:
            scope = self._scopes.pop(name)
            scope.epoch = 0  # its watch's events are ignored from now on
            if scope.task is not None:
                scope.task.cancel()
            self._clear(f"scope:{name}")
        for name, query in wanted.items():
            if name not in self._scopes:
                self._scopes[name] = _Scope(name, query)
        self._target = selection

    # -- one scope ---------------------------------------------------------------------------

    async def _open(self, scope: _Scope) -> None:
        """Open the scope's watch, then read its snapshot (watch before list)."""
        try:
            watch = await self.feed.open(scope.query)
        except Exception as exc:
            self._fail(f"scope:{scope.name}", f"watch of {scope.label} not opened: {exc}")
            return
        if self._scopes.get(scope.name) is not scope:
            await watch.close()
            return
        scope.epoch, scope.ready = next(self._epochs), False
        scope.task = asyncio.create_task(
            self._consume(scope, watch, scope.epoch), name=f"membership:{scope.label}"
        )
        await self._read(scope)

    async def _read(self, scope: _Scope) -> None:
        scope.dirty, scope.reading = False, True
        try:
            models = await self.feed.read(scope.query)
        except Exception as exc:
            scope.dirty = True  # read again at the next tick
            self._fail(f"scope:{scope.name}", f"snapshot of {scope.label} not read: {exc}")
            return
        finally:
            scope.reading = False
        scope.models = {m.key: m for m in models}
        scope.ready = True
        self._clear(f"scope:{scope.name}")

    async def _consume(self, scope: _Scope, watch: ScopeWatch, epoch: int) -> None:
        reason = "ended"
        try:
            async for change in watch:
                if scope.epoch != epoch:
                    return  # replaced or closed: its events no longer count
                self._on_change(scope, change)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"failed: {exc}"
        finally:
            await watch.close()
        if scope.epoch == epoch:
            scope.task = None  # reopened by the retry tick
            self._fail(f"scope:{scope.name}", f"watch of {scope.label} {reason}; reopening")

    def _on_change(self, scope: _Scope, change: Change) -> None:
        """Taints in place; anything else marks the scope dirty for the coalesced read."""
        if not scope.reading and isinstance(change, Put) and change.key.startswith(MODELS):
            handled = self._update_taints(scope, change)
            if handled is not None:
                if handled:
                    self._publish()
                return
        scope.dirty = True
        self._wake.set()

    @staticmethod
    def _update_taints(scope: _Scope, change: Put) -> bool | None:
        """True: taints applied; False: nothing changed; None: not a taint update."""
        try:
            key = parse_model_key(change.key)
            card = ModelCard.from_json(change.value)
        except (ValueError, CardError):
            return None
        model = scope.models.get(key)
        if model is None or not model.card.same_except_taints(card):
            return None
        if model.card.taints == card.taints:
            return False
        scope.models[key] = dataclasses.replace(model, card=card, revision=change.revision)
        return True

    # -- publishing --------------------------------------------------------------------------

    def _scopes_in_force(self, refs: Iterable[EndpointRef]) -> dict[str, tuple[Query, ...]]:
        if None in self._scopes:
            names = {endpoint.namespace for endpoint, _ in refs}
        else:
            names = {n for n in self._scopes if n is not None}
        scopes: dict[str, tuple[Query, ...]] = {}
        for name in sorted(names):
            inside = tuple(p.query for p in self.endpoint_prefixes if p.namespace == name)
            scopes[name] = inside or (Query(namespace=name),)
        return scopes

    def _admitted(self, endpoint: EndpointId) -> bool:
        prefixes = self.endpoint_prefixes
        if not prefixes:
            return True
        restricted = {p.namespace for p in prefixes}
        if endpoint.namespace not in restricted:
            return None not in self._scopes  # a listed namespace without prefixes: all of it
        return any(p.matches(endpoint) for p in prefixes)

    def _publish(self) -> None:
        """Send the view to subscribers if it differs from the last one sent."""
        grouped: dict[EndpointRef, list[ModelInstance]] = {}
        for scope in self._scopes.values():
            for model in scope.models.values():
                if self._admitted(model.key.endpoint):
                    ref = (model.key.endpoint, model.key.instance_id)
                    grouped.setdefault(ref, []).append(model)
        endpoints: dict[EndpointRef, EndpointView] = {}
        for ref, models in grouped.items():
            ordered = tuple(sorted(models, key=lambda m: m.key.sort_key()))
            before = self._endpoint_generations.get(ref)
            if before is None or before.models != ordered:
                before = EndpointView(ref[0], ref[1], ordered, next(self._generations))
            endpoints[ref] = before
        self._endpoint_generations = endpoints
        revision = self._applied.revision if self._applied is not None else None
        view = Membership(revision, self._scopes_in_force(endpoints), endpoints)
        self.status.count = len(view.scopes)
        if view.same_as(self.view):
            return
        self.view = view = dataclasses.replace(view, version=self.view.version + 1)
        for callback in self._subscribers:
            try:
                callback(view)
            except Exception:
                log.exception("membership subscriber %r failed", callback)

    # -- errors ------------------------------------------------------------------------------

    def _fail(self, what: str, message: str) -> None:
        """Record an error; logged once per distinct message, not on every tick."""
        errors = self.status.errors
        if errors.get(what) != message:
            kept = "the last applied membership stays in force" if self._applied else "none yet"
            log.warning("membership: %s (%s)", message, kept)
        errors.pop(what, None)
        errors[what] = message
        self.status.last_error = message

    def _clear(self, what: str) -> None:
        errors = self.status.errors
        if errors.pop(what, None) is not None:
            log.info("membership: %s recovered", what)
            self.status.last_error = next(reversed(errors.values()), None)
