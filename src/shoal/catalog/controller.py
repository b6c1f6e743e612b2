"""The models controller: the catalog's desired state made true, one pass per step.

    step:
      hold the leadership key (shoal/v1/leaders/models-controller) and have it in force,
      else stop every local worker and wait (`Fence` also stops them between passes)
      for each workspace, first (cheap: one listing each; a revoked key never waits behind
      the other phases of every workspace, which took ~47 s at 1,001 workspaces):
        keys               each API key's live secrets published as grants (hashes, never
                           secrets); a key that cannot be published keeps its grants as
                           they are
      then for each workspace (and, while they run, every workspace's keys again every
      `keys_interval`: a key revoked after the pass's keys waits for no provider, deployment
      or route of this pass, which hung providers make as long as one timeout a workspace):
        deployments phase  replicas started, polled, stopped; statuses; fleet providers
        providers phase    served models → entities, links, statuses, passthrough names
        routes             each virtual model's targets published to discovery, each route
                           on its own (a failure is that virtual model's status_message)

Leadership is checked again (`in_force`, a clock read) before each workspace's keys, before
each of its phases, before each grant and route written or deleted, and before each catalog
write (`Calls.guard`): a replica whose leadership lapsed mid-pass stops the pass
(`LeadershipLost`) instead of publishing from its listings while another leads.

Failures are isolated to what they come from: a row the client cannot read is left out of
its listing and left as it is; a deployment that cannot start is ERROR; a provider that
cannot be listed is ERROR; a route that cannot be written is reported on its virtual model;
anything else fails its workspace's pass, never the others'. A pass fails (the loop counts
it) only when every workspace failed.

Each phase lists what it needs once, reads entities through its own cache and flushes it in
a `finally`; a phase reads only after the previous one wrote, so no phase decides on state
another already changed. Every catalog call and every item beats the loop's heartbeat: a
long pass that advances is healthy, a pass stuck on one call is reported within
`max_silence` (three intervals). `ModelsControllerService` runs the loop beside the catalog
API (`shoal catalog serve`, `shoal up`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from shoal.catalog.backends import MAX_LOCAL_WORKERS, STOP_TIMEOUT, Backend, LocalBackend
from shoal.catalog.calls import Calls
from shoal.catalog.client import CatalogClient
from shoal.catalog.collector import PassCollections
from shoal.catalog.deployments import DeploymentsPhase
from shoal.catalog.errors import CatalogError, NotFoundError
from shoal.catalog.grants import KeysPhase
from shoal.catalog.kinds import VIRTUAL_MODELS
from shoal.catalog.leader import Leadership, LeadershipLost
from shoal.catalog.providers import FleetLister, ProvidersPhase, UrlLister
from shoal.catalog.resources import VirtualModel
from shoal.catalog.routing import SLICE, pause, publish, resolve
from shoal.controllers import Controller, ControllerManager, HeartbeatMixin, Loop
from shoal.discovery import Discovery
from shoal.store import Store, open_store

log = logging.getLogger(__name__)

ROLE = "models-controller"
FENCE = "models-controller-fence"


def _names(vm: VirtualModel) -> set[str]:
    """The model entities a virtual model routes to."""
    return {t.model_entity for t in vm.targets} or {vm.default_model}


def judged(virtual_models: Iterable[VirtualModel], unreadable: set[str]) -> Iterator[VirtualModel]:
    """The virtual models none of whose entities is unreadable, taken as `resolve` takes them,
    a slice at a time (judged all at once, 10,000 held the event loop ~10 ms before any)."""
    return (vm for vm in virtual_models if not _names(vm) & unreadable)


class PassError(Exception):
    """Every workspace of a pass failed; the message names them and why."""


@dataclass
class PassReport:
    """What one pass did: catalog calls made, routes written and deleted, per workspace."""

    calls: int = 0
    seconds: float = 0.0
    routes_written: int = 0
    routes_deleted: int = 0
    grants_written: int = 0
    grants_deleted: int = 0
    keys_failed: dict[str, str] = field(default_factory=dict)  # "workspace/key" -> why
    keys_sweeps: int = 0  # every workspace's keys published again while the other phases ran
    workspaces: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # workspace -> why its pass failed


class ModelsController(Controller, HeartbeatMixin):
    """Reconciles the catalog's workspaces (all, unless `workspaces` names some)."""

    def __init__(
        self,
        client: CatalogClient,
        store: Store,
        backend: Backend,
        session: aiohttp.ClientSession,
        *,
        leadership: Leadership | None = None,
        workspaces: list[str] | None = None,
        deployment_ttl: float = 3600.0,
        provider_timeout: float = 10.0,
        collections: PassCollections | None = None,
        keys_interval: float = 2.0,
    ) -> None:
        self.calls = Calls(client, self.emit_heartbeat, self._in_force)
        self.keys_interval = keys_interval  # keys published again while the other phases run
        self.store = store
        self.backend = backend
        self.leadership = leadership
        self.workspaces = workspaces
        self.deployments = DeploymentsPhase(self.calls, backend, ttl=deployment_ttl)
        self.providers = ProvidersPhase(
            self.calls, UrlLister(session, provider_timeout), FleetLister(Discovery(store)),
            timeout=provider_timeout,
        )  # fmt: skip
        self.keys = KeysPhase(self.calls, store, self.waiting_on)
        self.collections = collections  # full collections kept out of the passes
        self.last: PassReport | None = None
        self.passes = 0

    async def step(self) -> None:
        if self.leadership is not None and not await self._hold():
            await stop_local_work(self.backend, self.emit_heartbeat)  # nothing runs here
            return  # another replica leads, or this one waits out the last leader's lease
        if self.collections is None:
            await self._pass()
            return
        with self.collections.deferred():
            await self._pass()
        # (not after a failed pass: its traceback holds the listings; the next one collects)
        self.collections.after_pass()

    async def _pass(self) -> None:
        self.emit_heartbeat()
        self.providers.fleet.new_pass()  # (a namespace listed once a pass, for every workspace)
        report = PassReport()
        started, calls = time.monotonic(), self.calls.requests
        names = self.workspaces or [w.name for w in await self.calls.workspaces()]
        failed = report.failed
        await self._each(self._keys, names, report)  # every workspace's keys first
        done = asyncio.Event()
        keys = asyncio.create_task(self._keys_meanwhile(names, report, done), name="keys")
        try:
            await self._each(self._models, names, report)
        except BaseException:
            keys.cancel()  # (the loop stops: the next pass publishes them first)
            raise
        finally:
            done.set()
            await asyncio.wait([keys])  # (a sweep under way ends: never two at once)
            exc = None if keys.cancelled() else keys.exception()
            if exc is not None and not isinstance(exc, LeadershipLost):  # (the pass's own)
                log.warning("keys published meanwhile failed: %s", exc, exc_info=exc)
        report.calls = self.calls.requests - calls
        report.seconds = time.monotonic() - started
        self.last, self.passes = report, self.passes + 1
        if failed and len(failed) == len(names):  # nothing reconciled: the loop counts it
            raise PassError(f"{len(failed)} workspace(s) failed: " + "; ".join(
                f"{workspace}: {why}" for workspace, why in sorted(failed.items())
            ))  # fmt: skip

    async def _hold(self) -> bool:
        """`Leadership.hold`, its store calls a wait on the store every replica shares."""
        assert self.leadership is not None
        with self.waiting_on("the store"):
            return await self.leadership.hold()

    def _in_force(self) -> None:
        """`LeadershipLost` unless this replica's leadership is in force (a clock read)."""
        if self.leadership is not None and not self.leadership.in_force():
            raise LeadershipLost(f"{ROLE}: leadership no longer in force; the pass stops")

    async def _each(
        self,
        phase: Callable[[str, PassReport], Awaitable[None]],
        names: list[str],
        report: PassReport,
    ) -> None:
        """`phase` of each workspace, each one's failure its own."""
        failed = report.failed
        for workspace in names:
            self._in_force()
            try:
                await phase(workspace, report)
            except LeadershipLost:  # the pass ends; the fence stops what runs here
                raise
            except Exception as exc:  # that workspace's pass only, the others go on
                why = f"{type(exc).__name__}: {exc}"
                if workspace in failed:  # its keys failed, then its phases too
                    why = f"{failed[workspace]}; {why}"
                failed[workspace] = why[:1000]
                log.warning("workspace %s: pass failed: %s", workspace, exc, exc_info=exc)
            self.emit_heartbeat()

    async def _keys_meanwhile(
        self, names: list[str], report: PassReport, done: asyncio.Event
    ) -> None:
        """Every workspace's keys again every `keys_interval` until `done` (the other
        phases ended): one sweep at a time, each listing afresh, so an older listing never
        puts back a grant a newer one deleted. A workspace's failure is logged, its grants
        left as they are until the next sweep or pass."""
        while True:
            try:
                await asyncio.wait_for(done.wait(), self.keys_interval)
                return
            except TimeoutError:
                pass
            for workspace in names:
                self._in_force()
                try:
                    await self._keys(workspace, report)
                except LeadershipLost:
                    raise
                except Exception as exc:
                    log.warning("workspace %s: keys not published: %s", workspace, exc)
            report.keys_sweeps += 1

    async def _keys(self, workspace: str, report: PassReport) -> None:
        """One workspace's grants, published only while the leadership is in force."""
        keys = await self.keys.run(workspace, self._in_force)
        report.grants_written += keys.written
        report.grants_deleted += keys.deleted
        report.keys_failed.update({f"{workspace}/{k}": why for k, why in keys.failed.items()})

    async def _models(self, workspace: str, report: PassReport) -> None:
        """The phases of one workspace, in order, then its routes."""
        await self.deployments.run(workspace)
        self._in_force()
        result = await self.providers.run(workspace)
        if result.virtual_models is None:  # not read: the routes stay as they are
            return
        routes = await resolve(
            workspace, judged(result.virtual_models, result.unreadable_entities),
            result.entities.get, result.providers, beat=self.emit_heartbeat,
        )  # fmt: skip

        async def gone(name: str) -> bool:
            return await self._virtual_model_gone(workspace, name)

        published = await publish(
            self.store, workspace, routes, gone, beat=self.emit_heartbeat, guard=self._in_force,
            waiting_on=self.waiting_on,
        )  # fmt: skip
        report.routes_written += published.written
        report.routes_deleted += published.deleted
        await self._route_statuses(workspace, result.virtual_models, published.failed)
        report.workspaces.append(workspace)

    async def _virtual_model_gone(self, workspace: str, name: str) -> bool:
        """True only if a read by name finds no virtual model `name` (any doubt keeps it)."""
        try:
            await self.calls.get(VIRTUAL_MODELS, workspace, name)
        except NotFoundError:
            return True
        except Exception as exc:  # unreadable, or the catalog failed: the route stays
            log.warning("route %s/%s kept: its virtual model not read: %s", workspace, name, exc)
        return False

    async def _route_statuses(
        self, workspace: str, virtual_models: list[VirtualModel], failed: dict[str, str]
    ) -> None:
        """Each virtual model's `status_message`: why its route is not published, or empty."""
        for count, vm in enumerate(virtual_models, 1):
            if count % SLICE == 0:
                await pause(self.emit_heartbeat)
            message = failed.get(vm.name, "")[:4000]
            if vm.status_message == message:
                continue
            try:
                await self.calls.update(
                    VIRTUAL_MODELS, workspace, vm.name, {"status_message": message}, vm.version
                )
            except (CatalogError, aiohttp.ClientError, TimeoutError) as exc:  # next pass
                log.info("virtual model %s/%s: status not written: %s", workspace, vm.name, exc)


async def stop_local_work(backend: Backend, beat: Callable[[], None] = lambda: None) -> None:
    """Stop every worker the local backend runs (a replica not leading runs none), beating
    after each deployment stopped."""
    running = backend.running()
    if running:
        log.warning("not the leader (any more): stopping the workers of %d deployment(s)",
                    len(running))  # fmt: skip
    for workspace, name in sorted(running):
        await backend.stop(workspace, name)
        beat()


class Fence(Controller, HeartbeatMixin):
    """Stops the local workers as soon as leadership is not in force, between passes too:
    a leader cut off from the store (or frozen, then resumed) stops them before its lease
    can have ended plus one TTL, when a new leader may start its own (`shoal.catalog.leader`)."""

    def __init__(self, leadership: Leadership, backend: Backend) -> None:
        self.leadership = leadership
        self.backend = backend

    async def step(self) -> None:
        if not self.leadership.in_force():
            await stop_local_work(self.backend, self.emit_heartbeat)


@dataclass
class ControllerConfig:
    catalog_url: str
    store_url: str
    admin_token: str | None = None
    interval: float = 2.0
    log_dir: Path = Path(".")
    deployment_ttl: float = 3600.0
    leader_ttl: float = 10.0
    max_local_workers: int = MAX_LOCAL_WORKERS  # worker processes the local backend runs at most
    provider_timeout: float = 10.0  # at most; kept below the loop's max_silence (3 intervals)
    # Full garbage collections kept out of the passes (`shoal.catalog.collector`): process-wide
    # settings of the collector, which `shoal catalog serve` makes.
    defer_full_collections: bool = False


class ModelsControllerService:
    """The controller's loop with everything it holds: store, client, backend, leadership."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.manager = ControllerManager()
        self.store: Store | None = None
        self.client: CatalogClient | None = None
        self.session: aiohttp.ClientSession | None = None
        self.backend: LocalBackend | None = None
        self.leadership: Leadership | None = None
        self.controller: ModelsController | None = None

    async def start(self) -> None:
        """Open the store and start the loop; `StoreUnavailableError` if it is unreachable."""
        config = self.config
        self.store = await open_store(config.store_url)
        self.client = CatalogClient(config.catalog_url, token=config.admin_token)
        self.session = aiohttp.ClientSession()
        self.leadership = Leadership(self.store, ROLE, ttl=config.leader_ttl)
        self.backend = LocalBackend(
            config.store_url,
            config.log_dir,
            may_start=self.leadership.in_force,
            max_workers=config.max_local_workers,
        )
        self.controller = ModelsController(
            self.client, self.store, self.backend, self.session,
            leadership=self.leadership, deployment_ttl=config.deployment_ttl,
            provider_timeout=min(config.provider_timeout, 2 * config.interval),
            collections=PassCollections() if config.defer_full_collections else None,
            keys_interval=config.interval,
        )  # fmt: skip
        self.manager.register(Loop(self.controller, interval=config.interval, name=ROLE))
        fence, every = Fence(self.leadership, self.backend), min(config.leader_ttl / 4, 1.0)
        # Silent at most while one deployment's workers drain (SIGTERM, SIGKILL after 30 s).
        silence = 3 * every + STOP_TIMEOUT + 5
        self.manager.register(Loop(fence, interval=every, max_silence=silence, name=FENCE))
        await self.manager.start_all()

    async def stop(self) -> None:
        """Stop the loop, the workers it started, and give the leadership up."""
        await self.manager.stop_all()
        if self.backend is not None:
            await self.backend.close()
        if self.leadership is not None:
            try:
                await self.leadership.release()
            except Exception as exc:  # the store is gone: the lease expires on its own
                log.warning("leadership not released: %s", exc)
        for closing in (self.client, self.session, self.store):
            if closing is not None:
                await closing.close()
