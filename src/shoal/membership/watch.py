"""`MembershipWatch`: follow a source's selections and publish the endpoints in force.

The loop, in one place (`_run`): wait for a wake-up (an event, a new selection) or the
retry tick; let a burst settle (until `quiet` seconds pass without an event, at most
`max_delay` seconds after its first); then bring the desired selection into force, reopen
watches that ended, read a snapshot of each scope marked dirty (or of every scope at a full
reconciliation), and publish the view if it changed.

The invariants, both ways:
- Watch before list: a scope's watch starts at the store revision read before its snapshot,
  so whatever the snapshot misses the watch delivers, and an instance that left while the
  watch opened is not in the first view.
- Epochs: every watch opened gets a new epoch; events of a watch whose scope now has another
  epoch (it was replaced or closed) are ignored. A scope that stays selected keeps its watch,
  its epoch and its endpoints' generations.
- Make before break: a new selection's scopes are opened and read (at most `concurrency` at
  a time) while the old selection stays in force; the view and `applied_revision` move to it
  in one step, and only then are the scopes it dropped closed. An update not done within
  `update_timeout` leaves the old selection in force, says why in `last_error`, and is tried
  again at the next tick (scopes already opened for it are kept). An update replaced by a
  newer valid selection before it is done stops there and never goes into force: the newer
  one is set up next, from the scopes opened so far (the last of two quick rewrites wins, and
  the one it replaced never moves the view); the same selection again, after a source error,
  is no newer one: its set-up goes on.
- A source error changes nothing in force; only a valid selection (even an empty one) does.
- Taint updates are applied in place, O(1) each, and published coalesced: a view is built
  from the endpoints that changed since the last one, never from every endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import types
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping

from shoal.discovery import Discovery, EndpointId, Query
from shoal.discovery.keys import MODELS
from shoal.membership.discovery_source import EndpointPrefix
from shoal.membership.errors import MembershipError, SourceError
from shoal.membership.feed import Change, DiscoveryFeed, ScopeWatch
from shoal.membership.scope import YIELD_EVERY, Models, Scope, note_changes
from shoal.membership.selection import Selection, Source
from shoal.membership.view import EMPTY, EndpointRef, EndpointView, Membership, MembershipStatus
from shoal.store import Put

log = logging.getLogger(__name__)

QUIET_SECONDS = 0.1
MAX_DELAY_SECONDS = 1.0
RETRY_TICK_SECONDS = 1.0
RECONCILE_SECONDS = 30.0
SETUP_TIMEOUT_SECONDS = 10.0
CONCURRENCY = 32
OPEN_CHUNK = 128  # scopes opened after one read of the store revision


class MembershipWatch:
    """Turns a source's selections into a published `Membership` view and a status."""

    def __init__(
        self,
        discovery: Discovery,
        source: Source,
        *,
        endpoint_prefixes: Iterable[str | EndpointPrefix] = (),
        feed: DiscoveryFeed | None = None,
        quiet: float = QUIET_SECONDS,
        max_delay: float = MAX_DELAY_SECONDS,
        retry_tick: float = RETRY_TICK_SECONDS,
        reconcile_interval: float = RECONCILE_SECONDS,
        setup_timeout: float = SETUP_TIMEOUT_SECONDS,
        update_timeout: float | None = None,
        concurrency: int = CONCURRENCY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.feed = feed or DiscoveryFeed(discovery)
        self.source = source
        self.endpoint_prefixes = tuple(
            p if isinstance(p, EndpointPrefix) else EndpointPrefix.parse(p)
            for p in endpoint_prefixes
        )
        self.quiet = quiet
        self.max_delay = max_delay
        self.retry_tick = retry_tick
        self.reconcile_interval = reconcile_interval
        self.setup_timeout = setup_timeout
        self.update_timeout = setup_timeout if update_timeout is None else update_timeout
        self.concurrency = concurrency
        self.clock = clock
        self.status = MembershipStatus()
        self.view: Membership = EMPTY
        self._scopes: dict[str | None, Scope] = {}  # in force
        self._opening: dict[str | None, Scope] = {}  # for the desired selection, not yet
        self._epochs = itertools.count(1)
        self._generations = itertools.count(1)
        self._desired: Selection | None = None
        self._superseded = asyncio.Event()  # a new valid selection is desired
        self._applied: Selection | None = None
        # The view being built: endpoints as last published, those changed since, and
        # per namespace how many endpoints are in the view and how many were seen at all.
        self._endpoints: dict[EndpointRef, EndpointView] = {}
        self._changed: set[EndpointRef] = set()
        self._present: set[EndpointRef] = set()
        self._in_view: Counter[str] = Counter()
        self._seen: Counter[str] = Counter()
        self._view_scopes: Mapping[str, tuple[Query, ...]] = EMPTY.scopes
        # What `_view_scopes` is a copy of, changed by namespace as they move; the queries
        # of the namespaces the endpoint prefixes restrict.
        self._scope_map: dict[str, tuple[Query, ...]] = {}
        self._restricted: dict[str, tuple[Query, ...]] = {}
        for prefix in self.endpoint_prefixes:
            self._restricted[prefix.namespace] = (
                *self._restricted.get(prefix.namespace, ()),
                prefix.query,
            )
        self._rescope = False  # the view's namespaces are derived again (watch-all)
        self._publishing = asyncio.Lock()
        self._publisher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._burst: tuple[float, float] | None = None  # (first, last) event of a burst
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
        tasks = [*self._tasks, *([self._publisher] if self._publisher else [])]
        scopes = [*self._scopes.values(), *self._opening.values()]
        tasks += [s.task for s in scopes if s.task is not None]
        self._tasks, self._publisher = [], None
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
        """Each valid selection becomes the desired one; an error clears it (nothing to apply,
        the selection in force stays); a source that ends is reported and restarted."""
        while True:
            try:
                async for item in self.source.selections():
                    if isinstance(item, SourceError):
                        self._desired = self.status.desired_revision = None
                        self._fail("source", str(item))
                    else:
                        self.status.clear("source")
                        if item != self._desired:
                            self._superseded.set()
                        self._desired = item
                        self.status.desired_revision = item.revision
                    self._wake.set()
                self._fail("source", "namespace source closed; restarting it")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._fail("source", f"namespace source failed: {exc}; restarting it")
            await asyncio.sleep(self.retry_tick)

    # -- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        next_full = self.clock() + self.reconcile_interval
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.retry_tick):
                    await self._wake.wait()
            await self._settle()
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

    async def _settle(self) -> None:
        """Let a burst of events settle: until `quiet` seconds pass without an event, and at
        most `max_delay` seconds after its first; then the burst costs one read per scope."""
        while self._burst is not None:
            first, last = self._burst
            until = min(last + self.quiet, first + self.max_delay)
            now = time.monotonic()
            if now < until:
                await asyncio.sleep(until - now)
                continue
            if now >= first + self.max_delay:
                break
            await asyncio.sleep(0)  # events that queued up while the loop was held count
            if self._burst == (first, last):
                break
        self._burst = None

    async def _step(self, full: bool) -> None:
        desired = self._desired
        applied = self._applied
        if desired is not None and (applied is None or desired != applied):
            await self._update(desired)
        elif self._opening:  # the update was withdrawn (a source error, or back to applied)
            withdrawn, self._opening = list(self._opening.values()), {}
            self.status.clear("update")
            await self._close_all(withdrawn)
        scopes = list(self._scopes.values())
        await self._open_each([s for s in scopes if s.task is None])
        await self._each(
            [s for s in scopes if s.task is not None and (full or s.dirty or not s.ready)],
            self._read,
        )
        await self._publish()

    async def _update(self, selection: Selection) -> None:
        """Make before break: open and read the scopes `selection` adds, within
        `update_timeout`; then put it in force in one step and close what it dropped."""
        wanted: dict[str | None, Query] = (
            {None: Query()}
            if selection.watch_all
            else {ns: Query(namespace=ns) for ns in sorted(selection.namespaces)}
        )
        await self._close_all(
            [self._opening.pop(n) for n in list(self._opening) if n not in wanted]
        )
        for name, query in wanted.items():
            if name not in self._scopes and name not in self._opening:
                self._opening[name] = Scope(name, query)
        await self._set_up(selection)
        if self._desired is not None and self._desired != selection:
            log.info("membership: selection %s replaced before it was set up", selection.revision)
            return  # (the next step sets up the newer one)
        missing = [s for s in self._opening.values() if s.task is None or not s.ready]
        if missing:
            errors = [self.status.errors.get(f"scope:{s.name}") for s in missing]
            reason = next((e for e in errors if e), f"not done within {self.update_timeout:g}s")
            self._fail(
                "update",
                f"selection {selection.revision} not in force: {len(missing)} of "
                f"{len(self._opening)} new scopes not set up ({reason})",
            )
            return
        dropped = [s for name, s in self._scopes.items() if name not in wanted]
        scopes = {name: self._scopes.get(name) or self._opening[name] for name in wanted}
        for scope in [*self._opening.values(), *dropped]:
            self._changed.update(scope.endpoints)
        self._scopes, self._opening, self._applied = scopes, {}, selection
        if selection.watch_all:
            self._rescope = True
        else:
            self._view_scopes = self._scopes_of([n for n in scopes if n is not None])
        self.status.clear("update")
        await self._publish()
        self._first_applied.set()
        await self._close_all(dropped)

    async def _set_up(self, selection: Selection) -> None:
        """Open and read the scopes of `_opening` not set up yet; stops after
        `update_timeout`, or once a newer selection than `selection` is desired (not the
        same one again, after a source error: its set-up goes on)."""

        def replaced() -> bool:
            return self._desired is not None and self._desired != selection

        async def set_up() -> None:
            opening = list(self._opening.values())
            await self._open_each([s for s in opening if s.task is None])
            await self._each([s for s in opening if s.task is not None and not s.ready], self._read)

        async def superseded() -> None:
            while not replaced():
                self._superseded.clear()
                await self._superseded.wait()

        if replaced():
            return
        work = asyncio.ensure_future(set_up())
        newer = asyncio.ensure_future(superseded())
        try:
            await asyncio.wait(
                (work, newer), timeout=self.update_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (work, newer):
                task.cancel()
            await asyncio.gather(work, newer, return_exceptions=True)

    async def _each(self, scopes: list[Scope], action: Callable[[Scope], Awaitable[None]]) -> None:
        """`action` on every scope, at most `concurrency` at a time."""
        if not scopes:
            return
        limit = asyncio.Semaphore(self.concurrency)

        async def one(scope: Scope) -> None:
            async with limit:
                await action(scope)

        await asyncio.gather(*(one(s) for s in scopes))

    # -- one scope ---------------------------------------------------------------------------

    def _in_force(self, scope: Scope) -> bool:
        return self._scopes.get(scope.name) is scope

    async def _open_each(self, scopes: list[Scope]) -> None:
        """Open the scopes, `OPEN_CHUNK` at a time after one read of the store revision
        (watch before list holds: that read precedes every snapshot read of the chunk)."""
        for i in range(0, len(scopes), OPEN_CHUNK):
            chunk = scopes[i : i + OPEN_CHUNK]
            try:
                revision = await self.feed.revision()
            except Exception as exc:
                for scope in chunk:
                    self._fail(f"scope:{scope.name}", f"watch of {scope.label} not opened: {exc}")
                continue
            await self._each(chunk, functools.partial(self._open, revision=revision))

    async def _open(self, scope: Scope, revision: int) -> None:
        """Open the scope's watch from `revision` + 1, then read its snapshot."""
        try:
            watch = await self.feed.open(scope.query, revision)
        except Exception as exc:
            self._fail(f"scope:{scope.name}", f"watch of {scope.label} not opened: {exc}")
            return
        if scope.closed:
            await watch.close()
            return
        scope.epoch, scope.ready = next(self._epochs), False
        scope.task = asyncio.create_task(
            self._consume(scope, watch, scope.epoch), name=f"membership:{scope.label}"
        )
        await self._read(scope)

    async def _close_all(self, scopes: list[Scope]) -> None:
        """Close `scopes`, `YIELD_EVERY` at a time: a closed watch's tasks run in the next
        turn of the loop (4,096 closed at once: 11,600 callbacks in one turn, 1-1.3 s)."""
        try:
            for i, scope in enumerate(scopes, 1):
                self._close(scope)
                if i % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        finally:
            for scope in scopes:  # (stopped meanwhile: the rest at once)
                if not scope.closed:
                    self._close(scope)

    def _close(self, scope: Scope) -> None:
        """Stop the scope's watch; its events are ignored from now on, its listing dropped."""
        scope.closed, scope.epoch = True, 0
        if scope.task is not None:
            scope.task.cancel()
        self.feed.forget(scope.query)
        self.status.clear(f"scope:{scope.name}")

    async def _read(self, scope: Scope) -> None:
        scope.dirty, scope.reading = False, True
        try:
            models = await self.feed.read(scope.query)
            endpoints: dict[EndpointRef, Models] = {}
            for i, model in enumerate(models, 1):
                if i % (YIELD_EVERY * 4) == 0:
                    await asyncio.sleep(0)
                key = model.key
                endpoints.setdefault((key.endpoint, key.instance_id), {})[key] = model
        except Exception as exc:
            scope.dirty = True  # read again at the next tick
            self._fail(f"scope:{scope.name}", f"snapshot of {scope.label} not read: {exc}")
            return
        finally:
            scope.reading = False
        before, scope.endpoints, scope.ready = scope.endpoints, endpoints, True
        if self._in_force(scope) and not scope.closed:
            await note_changes(before, endpoints, self._changed)
        self.status.clear(f"scope:{scope.name}")

    async def _consume(self, scope: Scope, watch: ScopeWatch, epoch: int) -> None:
        reason = "ended"
        try:
            applied = 0
            async for change in watch:
                if scope.epoch != epoch:
                    return  # replaced or closed: its events no longer count
                self._on_change(scope, change)
                applied += 1
                if applied % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # a queued flood must not hold the loop
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"failed: {exc}"
        finally:
            await watch.close()
        if scope.epoch == epoch:
            scope.task = None  # reopened by the retry tick
            self._fail(f"scope:{scope.name}", f"watch of {scope.label} {reason}; reopening")

    def _on_change(self, scope: Scope, change: Change) -> None:
        """Taints in place; anything else marks the scope dirty for the coalesced read."""
        if not scope.reading and isinstance(change, Put) and change.key.startswith(MODELS):
            ref = scope.update_taints(change)
            if ref is not None:
                if ref and self._in_force(scope):
                    self._changed.add(ref)
                    self._publish_soon()
                return
        scope.dirty = True
        now = time.monotonic()
        self._burst = (self._burst[0] if self._burst else now, now)
        self._wake.set()

    # -- publishing --------------------------------------------------------------------------

    def _scopes_of(
        self,
        names: Iterable[str],
        fresh: Mapping[str, tuple[Query, ...]] = types.MappingProxyType({}),
    ) -> Mapping[str, tuple[Query, ...]]:
        """The scopes of exactly `names`: a namespace kept keeps its very queries (a consumer
        compares them by identity); the others take those made ahead (`fresh`), or new ones."""
        old = self._scope_map
        self._scope_map = {
            name: old.get(name) or fresh.get(name) or self._queries_of(name) for name in names
        }
        return types.MappingProxyType(dict(self._scope_map))

    def _queries_of(self, name: str) -> tuple[Query, ...]:
        return self._restricted.get(name) or (Query(namespace=name),)

    def _admitted(self, endpoint: EndpointId) -> bool:
        prefixes = self.endpoint_prefixes
        if not prefixes:
            return True
        restricted = {p.namespace for p in prefixes}
        if endpoint.namespace not in restricted:
            return None not in self._scopes  # a listed namespace without prefixes: all of it
        return any(p.matches(endpoint) for p in prefixes)

    def _models_of(self, ref: EndpointRef) -> Models | None:
        scope = self._scopes.get(None) or self._scopes.get(ref[0].namespace)
        return None if scope is None else scope.endpoints.get(ref)

    def _publish_soon(self) -> None:
        """Publish the endpoints changed in place (taints) once per `quiet` window."""
        if self._publisher is None or self._publisher.done():
            self._publisher = asyncio.create_task(self._publish_later(), name="membership-taints")

    async def _publish_later(self) -> None:
        while self._changed:
            await asyncio.sleep(self.quiet)
            await self._publish()

    async def _publish(self) -> None:
        """Rebuild the changed endpoints (yielding every `YIELD_EVERY`), then send the view
        to subscribers if it differs from the last one sent."""
        async with self._publishing:
            changed, self._changed = self._changed, set()
            updates: dict[EndpointRef, EndpointView | None] = {}
            fresh: dict[str, tuple[Query, ...]] = {}  # queries made ahead for watch-all
            for i, ref in enumerate(changed, 1):
                if i % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                models = self._models_of(ref)
                self._note_seen(ref, bool(models))
                before = self._endpoints.get(ref)
                if not models or not self._admitted(ref[0]):
                    if before is not None:
                        updates[ref] = None
                    continue
                ordered = tuple(sorted(models.values(), key=lambda m: m.key.sort_key()))
                if before is None or before.models != ordered:
                    updates[ref] = EndpointView(ref[0], ref[1], ordered, next(self._generations))
                namespace = ref[0].namespace
                if namespace not in self._scope_map and namespace not in fresh:
                    fresh[namespace] = self._queries_of(namespace)
            # From here to the end nothing awaits: the view changes in one step.
            endpoints = self._endpoints
            moved: set[str] = set()  # namespaces that joined or left the view
            for ref, endpoint in updates.items():
                namespace = ref[0].namespace
                if endpoint is None:
                    del endpoints[ref]
                    self._in_view[namespace] -= 1
                    if not self._in_view[namespace]:
                        del self._in_view[namespace]
                        moved.add(namespace)
                else:
                    if ref not in endpoints:
                        self._in_view[namespace] += 1
                        if self._in_view[namespace] == 1:
                            moved.add(namespace)
                    endpoints[ref] = endpoint
            watch_all = None in self._scopes
            if watch_all and self._rescope:
                self._view_scopes, self._rescope = self._scopes_of(self._in_view, fresh), False
            elif watch_all and moved:  # (only what moved: 10,000 namespaces, one joins)
                scope_map = self._scope_map
                for namespace in moved:
                    if namespace in self._in_view:
                        queries = fresh.get(namespace) or self._queries_of(namespace)
                        scope_map[namespace] = scope_map.get(namespace) or queries
                    else:
                        scope_map.pop(namespace, None)
                self._view_scopes = types.MappingProxyType(dict(scope_map))
            revision = self._applied.revision if self._applied is not None else None
            connection = self._applied.connection_revision if self._applied is not None else None
            self.status.count = len(self._seen) if watch_all else len(self._view_scopes)
            if (
                not updates
                and revision == self.view.revision
                and connection == self.view.connection_revision
                and self._view_scopes is self.view.scopes
            ):
                return
            self.view = view = Membership(
                revision,
                self._view_scopes,
                types.MappingProxyType(dict(endpoints)),
                self.view.version + 1,
                connection,
            )
            self.status.applied_revision = revision
            self.status.connection_revision = connection
            for callback in self._subscribers:
                try:
                    callback(view)
                except Exception:
                    log.exception("membership subscriber %r failed", callback)

    def _note_seen(self, ref: EndpointRef, present: bool) -> None:
        """Count the endpoints seen per namespace, admitted or not (`count` with watch-all)."""
        namespace = ref[0].namespace
        if present and ref not in self._present:
            self._present.add(ref)
            self._seen[namespace] += 1
        elif not present and ref in self._present:
            self._present.discard(ref)
            self._seen[namespace] -= 1
            if not self._seen[namespace]:
                del self._seen[namespace]

    # -- errors ------------------------------------------------------------------------------

    def _fail(self, what: str, message: str) -> None:
        kept = "the last applied membership stays in force" if self._applied else "none yet"
        self.status.fail(what, message, kept)
