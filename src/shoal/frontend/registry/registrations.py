"""Registrations: what a frontend knows of each `ModelKey` it watches and how far its
registration got (pending its metadata files, joined to its worker set, or refused), and the
moves that change them under the generation fence (watcher.py tells the fence and the two
paths, events and reconciliation, that make the moves).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import logging
import time
from dataclasses import dataclass

from shoal.discovery import (
    ModelInstance,
    ModelKey,
)
from shoal.frontend.registry.metadata import MetadataCache
from shoal.frontend.registry.metrics import FrontendMetrics
from shoal.frontend.registry.registry import RefusedError, Registry, SetId
from shoal.frontend.registry.versions import Versions

log = logging.getLogger(__name__)

JOIN_BATCH = 64
"""Cards a finished metadata fetch joins between two yields to the event loop."""


class State(enum.Enum):
    PENDING = "pending"  # metadata files not fetched and verified yet
    JOINED = "joined"  # in its worker set, routable unless tainted
    REFUSED = "refused"  # its checksum differs from its worker set's


@dataclass(eq=False, slots=True)
class Registration:
    """What this frontend knows of one `ModelKey`, and how far its registration got, and its
    key's generation (watcher.py: the generation fence)."""

    model: ModelInstance
    generation: int
    state: State = State.PENDING
    waiters: Waiters | None = None  # the cards it waits with for its metadata files
    error: str | None = None

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The metadata fetch it waits on (its waiters'), None when it waits for none."""
        return None if self.waiters is None else self.waiters.task


@dataclass(eq=False, slots=True)
class Waiters:
    """The registrations waiting for one set of metadata files (by checksum), and the one
    task that fetches them: a fleet's cold start has a hundred thousand cards waiting on the
    files of ten thousand models, and a task each cost more CPU and memory than the joins.
    The oldest waiter's URLs are tried; when they fail, the next waiter's, and so on."""

    files: tuple[str, ...]  # the checksums missing, sorted
    members: dict[ModelKey, Registration]
    task: asyncio.Task[None] | None = None


JOIN_LINES = 10  # new models named at INFO in a second; the others are counted


class JoinLines:
    """The INFO lines of new models after the first load: the first `JOIN_LINES` of a
    second are named, the rest counted in one line when the second is over. A worker
    announcing 20,000 adapters to a running frontend wrote 20,000 lines, a third of the
    joins' CPU."""

    __slots__ = ("_flush", "_more", "_named", "_since")

    def __init__(self) -> None:
        self._since = 0.0
        self._named = 0
        self._more = 0
        self._flush: asyncio.TimerHandle | None = None

    def named(self) -> bool:
        """Whether this new model is named at INFO (otherwise it is counted)."""
        now = time.monotonic()
        if now - self._since >= 1.0 and self._more == 0:
            self._since, self._named = now, 0
        if self._named < JOIN_LINES:
            self._named += 1
            return True
        self._more += 1
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_at(
                asyncio.get_running_loop().time() + max(0.0, self._since + 1.0 - now),
                self._say,
            )
        return False

    def _say(self) -> None:
        self._flush = None
        if self._more:
            log.info("%d more models joined in the last second (named at DEBUG)", self._more)
        self._since, self._named, self._more = time.monotonic(), 0, 0

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._say()


class Registrations:
    """The registrations of a `ModelWatcher` and the moves that change them: add, remove,
    retaint, fetch the metadata and join the worker set, or refuse. Each move's caller takes
    the key's next generation first (`_bump`). `ModelWatcher` owns the state, declared here."""

    registry: Registry
    cache: MetadataCache
    metrics: FrontendMetrics
    registrations: dict[ModelKey, Registration]
    # The registered keys by namespace, when the scope follows a membership (else None): a
    # namespace that leaves drops its own keys without a scan of every registration.
    _by_namespace: dict[str, set[ModelKey]] | None
    versions: Versions[SetId, ModelKey]
    _refused: dict[SetId, dict[ModelKey, Registration]]
    _generations: dict[
        ModelKey, int
    ]  # of keys with no registration (removed, or about to be added)
    _clock: int
    _epochs: list[int]
    fetching: int  # registrations with a metadata fetch in flight
    no_fetches: asyncio.Event  # set while `fetching` is 0
    _waiting: dict[tuple[str, ...], Waiters]  # by the checksums they wait for
    _joinable: collections.deque[tuple[Waiters, asyncio.Future[None]]]  # fetched: to join
    _joiner: asyncio.Task[None] | None  # joins them (`_join_ready`), while there are some
    quiet_joins = False  # (a first load: joins logged at DEBUG, counted by progress lines)
    join_lines: JoinLines  # how many new models are named at INFO

    # -- the generation fence ----------------------------------------------------------------

    def _bump(self, key: ModelKey) -> int:
        self._clock += 1
        registration = self.registrations.get(key)
        if registration is not None:
            registration.generation = self._clock
        else:
            self._generations[key] = self._clock
        return self._clock

    def _prune_generations(self) -> None:
        """Forget removed keys that no listing being applied can still be older than (only
        keys without a registration are here: a pass over a fleet does not walk it)."""
        floor = min(self._epochs, default=self._clock)
        for key in [k for k, generation in self._generations.items() if generation <= floor]:
            del self._generations[key]

    # -- the moves ------------------------------------------------------------------------

    def _add(self, model: ModelInstance) -> Registration:
        key = model.key
        current = self.registrations.get(key)
        if current is not None:
            if current.model == model:
                return current
            if current.model.instance == model.instance and current.model.card.same_except_taints(
                model.card
            ):
                self._set_taints(key, model.card.taints, model.revision)
                return current
            self._remove(key)
        registration = Registration(model, self._generations.pop(key, self._clock))
        self.registrations[key] = registration
        if self._by_namespace is not None:
            self._by_namespace.setdefault(key.endpoint.namespace, set()).add(key)
        set_id = self._track(model)
        self._try_join(registration)
        self._settle(set_id)
        return registration

    def _remove(self, key: ModelKey) -> None:
        registration = self.registrations.pop(key, None)
        if registration is None:
            self.registry.leave(key)
            return
        self._generations[key] = registration.generation  # (what a stale listing is older than)
        if self._by_namespace is not None:
            keys = self._by_namespace.get(key.endpoint.namespace)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_namespace[key.endpoint.namespace]
        self._stop_waiting(registration)
        model = registration.model
        set_id = SetId.of(key, model.card)
        self._refused.get(set_id, {}).pop(key, None)
        self.versions.drop(set_id, model.mdcsum, key)
        self.registry.leave(key)
        self._settle(set_id)

    def _set_taints(self, key: ModelKey, taints: tuple[str, ...], revision: int) -> None:
        registration = self.registrations.get(key)
        if registration is None:
            return
        model = registration.model
        registration.model = dataclasses.replace(
            model, card=model.card.with_taints(taints), revision=revision
        )
        self.registry.set_taints(key, tuple(registration.model.card.taints))
        self._settle(self._track(registration.model))

    # -- the elected checksum ----------------------------------------------------------------

    def _track(self, model: ModelInstance) -> SetId:
        """Enter the card in its worker set's election; returns the set's id."""
        set_id = SetId.of(model.key, model.card)
        self.versions.put(set_id, model.mdcsum, model.key, model.revision, bool(model.card.taints))
        return set_id

    def _settle(self, set_id: SetId) -> None:
        """Make the registry's set run the elected checksum: members of another one leave
        (refused, they wait), and the elected checksum's refused cards join."""
        elected = self.versions.elected(set_id)
        entry = self.registry.models.get(set_id.model)
        ws = None if entry is None else entry.sets.get(set_id)
        if ws is not None and ws.mdcsum != elected:
            log.warning(
                "model %r in %s/%s (%s): checksum %s elected, replacing %s",
                set_id.model, set_id.namespace, set_id.component, set_id.role, elected, ws.mdcsum,
            )  # fmt: skip
            for key in list(ws.members):
                self.registry.leave(key)
                registration = self.registrations.get(key)
                if registration is not None:
                    self._refuse(registration, self._not_elected(registration.model, elected))
            ws = None
        if ws is None and elected is not None:
            for registration in list(self._refused.get(set_id, {}).values()):
                if registration.model.mdcsum == elected:
                    self._try_join(registration)

    def _refuse(self, registration: Registration, error: str) -> None:
        model = registration.model
        if registration.state is not State.REFUSED:
            log.error("%s", error)
            self.metrics.card_refused(model.card.display_name)
        registration.state, registration.error = State.REFUSED, error
        refused = self._refused.setdefault(SetId.of(model.key, model.card), {})
        refused[model.key] = registration

    @staticmethod
    def _not_elected(model: ModelInstance, elected: str | None) -> str:
        return (
            f"card {model.key} of {model.card.display_name!r} has checksum {model.mdcsum}, "
            f"but its worker set in {model.key.endpoint.namespace}/"
            f"{model.key.endpoint.component} ({model.card.role}) runs {elected} (the checksum "
            "of its oldest untainted card): refused until that version drains or leaves"
        )

    # -- joining -----------------------------------------------------------------------------

    def _try_join(self, registration: Registration) -> None:
        """Join now if the metadata is cached, else wait with the other cards missing the
        same files for the one fetch of them (started here for the first)."""
        if registration.waiters is not None:
            return
        # Not looked for on disk here: a reconciliation pass registers 64 cards between two
        # yields, and a `stat` each, with the GIL to take back from the threads busy in a cold
        # start (the store's, the cache writer's), held the loop 0.3 s. The fetch looks, in a thread.
        missing = self.cache.missing(registration.model.card)
        if not missing:
            self._join(registration)
            return
        files = tuple(sorted(file.checksum for file in missing.values()))
        waiters = self._waiting.get(files)
        if waiters is None:
            waiters = self._waiting[files] = Waiters(files, {})
            waiters.task = asyncio.create_task(
                self._fetch_and_join(waiters), name=f"fetch:{registration.model.key}"
            )
        waiters.members[registration.model.key] = registration
        registration.waiters = waiters
        self.fetching += 1
        self.no_fetches.clear()

    def _stop_waiting(self, registration: Registration, *, joining: bool = False) -> None:
        """`registration` no longer waits for its fetch (joined, failed, or removed); unless
        it is `joining`, the fetch is cancelled when nobody waits for it any more (the
        downloads themselves are shared by checksum, and go on for whoever else needs them)."""
        waiters = registration.waiters
        if waiters is None:
            return
        registration.waiters = None
        self.fetching -= 1
        if not self.fetching:
            self.no_fetches.set()
        key = registration.model.key
        if waiters.members.get(key) is registration:
            del waiters.members[key]
            task = waiters.task
            if (
                not waiters.members
                and not joining
                and task is not None
                and task is not asyncio.current_task()
            ):
                task.cancel()

    async def _fetch_and_join(self, waiters: Waiters) -> None:
        """Fetch the files `waiters` miss with the oldest waiter's URLs (the next waiter's
        when those fail: that card stays pending, with the error, for reconciliation to
        retry), then have every waiter joined (`_join_ready`) before it ends."""
        try:
            failed = 0
            while waiters.members:
                registration = next(iter(waiters.members.values()))
                try:
                    await self.cache.fetch(registration.model.card)
                except Exception as exc:
                    if waiters.members.get(registration.model.key) is registration:
                        registration.error = str(exc)
                        self._stop_waiting(registration)
                        self.metrics.metadata_fetch_failures.inc()
                        log.warning(
                            "metadata of %s not fetched (retried by reconciliation): %s",
                            registration.model.key, exc,
                        )  # fmt: skip
                    failed += 1
                    if failed % JOIN_BATCH == 0:  # (a refusal can come without a download)
                        await asyncio.sleep(0)
                    continue
                break
            if waiters.members:
                # Joined by the one joiner: the fetches of thousands of models end in one
                # wake-up of the loop (the cache writer answers a batch at once), and each
                # joining its own cards then held it for all of them.
                joined = asyncio.get_running_loop().create_future()
                self._joinable.append((waiters, joined))
                if self._joiner is None:
                    self._joiner = asyncio.create_task(self._join_ready(), name="metadata:join")
                await joined
        finally:
            if self._waiting.get(waiters.files) is waiters:
                del self._waiting[waiters.files]
            for registration in list(waiters.members.values()):  # (cancelled: nobody waits)
                self._stop_waiting(registration)

    async def _join_ready(self) -> None:
        """Join the waiters of every fetch that ended, `JOIN_BATCH` cards between two yields
        (whichever fetches they came from); each fetch's task ends once its cards joined."""
        count = 0
        try:
            while self._joinable:
                waiters, joined = self._joinable.popleft()
                while waiters.members:  # (more may come while it yields)
                    for registration in list(waiters.members.values()):
                        if registration.waiters is not waiters:
                            continue  # removed meanwhile
                        self._stop_waiting(registration, joining=True)
                        try:
                            self._join(registration)
                        except Exception:
                            log.exception("joining %s failed", registration.model.key)
                        count += 1
                        if count % JOIN_BATCH == 0:
                            await asyncio.sleep(0)
                if not joined.done():
                    joined.set_result(None)
        finally:
            self._joiner = None

    def _join(self, registration: Registration) -> bool:
        """Add the card to its worker set; False (and logged once) if it is refused."""
        model = registration.model
        set_id = SetId.of(model.key, model.card)
        elected = self.versions.elected(set_id)
        if elected != model.mdcsum:
            self._refuse(registration, self._not_elected(model, elected))
            return False
        try:
            ws = self.registry.join(model)
        except RefusedError as exc:
            self._refuse(registration, str(exc))
            return False
        except ValueError as exc:  # an instance URL the proxy cannot use
            self._refuse(registration, f"card {model.key} refused: {exc}")
            return False
        self._refused.get(set_id, {}).pop(model.key, None)
        registration.state, registration.error = State.JOINED, None
        # The first instance of a worker set at INFO, the others at DEBUG: a fleet's cold
        # start would write a line per instance (100,000 lines, a second of CPU); during
        # the first load, all at DEBUG (10,000 models: 0.3 s), its progress lines at INFO.
        first = len(ws.members) == 1 and not self.quiet_joins
        log.log(
            logging.INFO if first and self.join_lines.named() else logging.DEBUG,
            "model %r: instance %x joined (%s; %d in its worker set)",
            model.card.display_name,
            model.instance_id,
            model.key.endpoint,
            len(ws.members),
        )
        return True

    async def _quiet_while_loading(self, loaded: asyncio.Event, window: float) -> None:
        """`quiet_joins` until `loaded` and the first load's fetches ended (at most `window`
        seconds after `loaded`), then a line of where loading got."""
        self.quiet_joins = True
        fetched = False
        try:
            await loaded.wait()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(window):
                    await self.no_fetches.wait()
                    fetched = True
        finally:
            self.quiet_joins = False
        if fetched:
            log.info(
                "discovery: the first load's metadata is fetched: %d joined", len(self.registry)
            )
        else:
            log.info(
                "discovery: the first load's metadata is still fetching after %gs: "
                "%d joined, %d fetching",
                window,
                len(self.registry),
                self.fetching,
            )

    # -- reading -----------------------------------------------------------------------------

    def incomplete(self) -> list[Registration]:
        """Registrations not joined: metadata pending, or refused."""
        return [r for r in self.registrations.values() if r.state is not State.JOINED]
