"""The models controller: the catalog's desired state made true, one pass per step.

    step:
      hold the leadership key (shoal/v1/leaders/models-controller), else wait
      for each workspace:
        deployments phase  replicas started, polled, stopped; statuses; fleet providers
        providers phase    served models → entities, links, statuses, passthrough names
        routes             each virtual model's targets published to discovery

Each phase lists what it needs once, reads entities through its own cache and flushes it in a
`finally`; a phase reads only after the previous one wrote, so no phase decides on state
another already changed. Every catalog call and every item beats the loop's heartbeat: a
long pass that advances is healthy, a pass stuck on one call is reported within
`max_silence` (three intervals). `ModelsControllerService` runs the loop beside the catalog
API (`shoal catalog serve`, `shoal up`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from shoal.catalog.backends import Backend, LocalBackend
from shoal.catalog.calls import Calls
from shoal.catalog.client import CatalogClient
from shoal.catalog.deployments import DeploymentsPhase
from shoal.catalog.errors import CatalogError
from shoal.catalog.leader import Leadership
from shoal.catalog.providers import FleetLister, ProvidersPhase, UrlLister
from shoal.catalog.routing import publish, resolve
from shoal.controllers import Controller, ControllerManager, HeartbeatMixin, Loop
from shoal.discovery import Discovery
from shoal.store import Store, StoreError, open_store

log = logging.getLogger(__name__)

ROLE = "models-controller"


class PassError(Exception):
    """Some workspaces of a pass failed (the others were reconciled); the message names them."""


@dataclass
class PassReport:
    """What one pass did: catalog calls made, routes written and deleted, per workspace."""

    calls: int = 0
    seconds: float = 0.0
    routes_written: int = 0
    routes_deleted: int = 0
    workspaces: list[str] = field(default_factory=list)


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
    ) -> None:
        self.calls = Calls(client, self.emit_heartbeat)
        self.store = store
        self.leadership = leadership
        self.workspaces = workspaces
        self.deployments = DeploymentsPhase(self.calls, backend, ttl=deployment_ttl)
        self.providers = ProvidersPhase(
            self.calls, UrlLister(session, provider_timeout), FleetLister(Discovery(store))
        )
        self.last: PassReport | None = None
        self.passes = 0

    async def step(self) -> None:
        if self.leadership is not None and not await self.leadership.hold():
            return  # another replica leads: wait
        self.emit_heartbeat()
        report = PassReport()
        started, calls = time.monotonic(), self.calls.requests
        names = self.workspaces or [w.name for w in await self.calls.workspaces()]
        failed: dict[str, str] = {}
        for workspace in names:
            try:
                await self._workspace(workspace, report)
            except (CatalogError, StoreError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                failed[workspace] = f"{type(exc).__name__}: {exc}"  # the others go on
                log.warning("workspace %s: pass failed: %s", workspace, exc, exc_info=exc)
            self.emit_heartbeat()
        report.calls = self.calls.requests - calls
        report.seconds = time.monotonic() - started
        self.last, self.passes = report, self.passes + 1
        if failed:  # the loop counts the pass as failed, and health says why if it lasts
            raise PassError(f"{len(failed)} workspace(s) failed: " + "; ".join(
                f"{workspace}: {why}" for workspace, why in sorted(failed.items())
            ))  # fmt: skip

    async def _workspace(self, workspace: str, report: PassReport) -> None:
        """The phases of one workspace, in order, then its routes."""
        await self.deployments.run(workspace)
        result = await self.providers.run(workspace)
        if result.virtual_models is None:  # not read: the routes stay as they are
            return
        routes = resolve(workspace, result.virtual_models, result.entities.get, result.providers)
        written, deleted = await publish(self.store, workspace, routes)
        report.routes_written += written
        report.routes_deleted += deleted
        report.workspaces.append(workspace)


@dataclass
class ControllerConfig:
    catalog_url: str
    store_url: str
    admin_token: str | None = None
    interval: float = 2.0
    log_dir: Path = Path(".")
    deployment_ttl: float = 3600.0
    leader_ttl: float = 10.0


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
        self.backend = LocalBackend(config.store_url, config.log_dir)
        self.leadership = Leadership(self.store, ROLE, ttl=config.leader_ttl)
        self.controller = ModelsController(
            self.client, self.store, self.backend, self.session,
            leadership=self.leadership, deployment_ttl=config.deployment_ttl,
        )  # fmt: skip
        self.manager.register(Loop(self.controller, interval=config.interval, name=ROLE))
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
