"""The deployments phase: each deployment's status made true by a backend, from one listing.

    CREATED           → start the replicas, go PENDING
    PENDING / READY   → poll (drift repaired by the backend); PENDING → READY once all are
                        ready; replicas that keep failing → ERROR
    DELETING          → stop, go DELETED
    ERROR             → replicas stopped
    DELETED / ERROR   → the row deleted once unchanged for `ttl` seconds

Each deployment is isolated: one whose backend call fails (it cannot start at all: errno 7,
a command line too long; a file that cannot be made) is ERROR with the reason and its
workers stopped; any other failure (a catalog error, an answer that is not JSON, a timeout)
leaves it, its workers and (READY) its provider as they are, for the next pass; the others
go on either way. A row the client cannot read
is left as it is: its workers keep running and its provider stays.

A READY deployment has a `fleet` provider, `deployment-{name}` (autoprovisioned, serving the
deployment's model from its namespace). Every other autoprovisioned `deployment-*` provider
(its deployment is not READY, or gone) is removed: its entity links are unlinked through the
phase's entity cache, flushed in a `finally`, and the provider is deleted. Replicas the
backend runs for a deployment that is not listed as wanted are stopped.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from shoal.catalog.backends import Backend, Observed
from shoal.catalog.cache import EntityCache
from shoal.catalog.calls import Calls
from shoal.catalog.errors import CatalogError, ConflictError, NotFoundError
from shoal.catalog.kinds import DEPLOYMENTS, PROVIDERS
from shoal.catalog.leader import LeadershipLost
from shoal.catalog.resources import Deployment, DeploymentStatus, Provider

log = logging.getLogger(__name__)

S = DeploymentStatus
T = TypeVar("T")
PROVIDER_PREFIX = "deployment-"


def fleet_provider_name(deployment: str) -> str:
    return PROVIDER_PREFIX + deployment


def fleet_provider(deployment: Deployment) -> dict[str, Any]:
    """The provider a READY deployment gets: its model, from its namespace."""
    return {
        "name": fleet_provider_name(deployment.name),
        "type": "fleet",
        "namespace": deployment.namespace,
        "enabled_models": [deployment.model],
        "autoprovisioned": True,
        "description": f"the workers of deployment {deployment.name}",
    }


class BackendFailed(Exception):
    """The backend itself failed (`cause`): the deployment cannot run, as opposed to a
    failure of the catalog around it, which is retried next pass."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


async def _backend(call: Awaitable[T]) -> T:
    """`call` to the backend, its failure (other than the leadership's) as `BackendFailed`."""
    try:
        return await call
    except LeadershipLost:
        raise
    except Exception as exc:
        raise BackendFailed(exc) from exc


class DeploymentsPhase:
    """One pass over one workspace's deployments."""

    def __init__(
        self,
        calls: Calls,
        backend: Backend,
        *,
        ttl: float,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.calls = calls
        self.backend = backend
        self.ttl = ttl
        self.now = now
        self._had_providers: dict[str, bool] = {}  # workspace -> deployment providers left

    async def run(self, workspace: str) -> None:
        # One listing of every deployment, grouped here: one per status missed a row whose
        # status none names (a newer catalog's), and a row whose status changed between two
        # of them, and stopped its workers as if it were gone.
        everything = await self.calls.list_all(DEPLOYMENTS, workspace)
        listed: dict[S, list[Deployment]] = {status: [] for status in S}
        for deployment in everything:
            listed[deployment.status].append(deployment)
        # Rows this controller cannot read: their workers and providers are left as they are.
        unreadable = set(everything.invalid)
        ready: list[Deployment] = []
        kept: set[str] = set()  # READY, their step failed on the catalog: left as they are
        for status in S:
            for deployment in listed[status]:
                now = await self._isolated(deployment, self._one(deployment))
                if now is S.READY:
                    ready.append(deployment)
                elif now is None and deployment.status is S.READY:
                    kept.add(deployment.name)  # (its provider too, not taken for stale)
                self.calls.beat()
        wanted = {d.name for s in (S.CREATED, S.PENDING, S.READY) for d in listed[s]}
        for running_workspace, name in sorted(self.backend.running()):
            if running_workspace == workspace and name not in wanted | unreadable:
                log.info("deployment %s/%s is gone: stopping its workers", workspace, name)
                await self.backend.stop(workspace, name)
        # Providers are read while deployments exist, or their providers did at the last
        # read: a steady workspace without deployments pays no call for them.
        if everything or unreadable or self._had_providers.get(workspace, True):
            self._had_providers[workspace] = await self._providers(
                workspace, ready, unreadable | kept
            )

    async def _one(self, deployment: Deployment) -> S | None:
        """One deployment's step; the status it is left in, or None if it has none yet."""
        workspace, name = deployment.workspace, deployment.name
        if deployment.status is S.CREATED:
            await _backend(self.backend.start(deployment))
            await self._set(deployment, S.PENDING, f"starting {deployment.replicas} worker(s)")
            return S.PENDING
        if deployment.status in (S.PENDING, S.READY):
            return await self._poll(deployment, await _backend(self.backend.poll(deployment)))
        await _backend(self.backend.stop(workspace, name))
        if deployment.status is S.DELETING:
            await self._set(deployment, S.DELETED, "stopped")
            return S.DELETED
        await self._collect(deployment)  # DELETED or ERROR
        return deployment.status

    async def _isolated(self, deployment: Deployment, step: Awaitable[S | None]) -> S | None:
        """Run one deployment's step. A failure of the backend itself (it cannot run: errno
        7, 36, ...) is that deployment's ERROR, its workers stopped and the reason in its
        status; any other failure (the catalog answered an error, or garbage, or not at all)
        leaves the deployment and its workers as they are, for the next pass. Neither is
        ever its workspace's."""
        try:
            return await step
        except LeadershipLost:  # not this deployment's fault: the pass ends here
            raise
        except BackendFailed as failed:  # it cannot run: ERROR, with the reason
            exc = failed.cause
            log.warning("deployment %s/%s cannot run: %s", deployment.workspace,
                        deployment.name, exc, exc_info=exc)  # fmt: skip
            with contextlib.suppress(Exception):
                await self.backend.stop(deployment.workspace, deployment.name)
            message = f"cannot start: {type(exc).__name__}: {exc}"[:4000]
            try:
                await self._set(deployment, S.ERROR, message)
            except Exception as write_error:  # the catalog: next pass
                log.warning("deployment %s/%s: status not written (next pass): %s",
                            deployment.workspace, deployment.name, write_error)  # fmt: skip
            return S.ERROR
        except Exception as exc:  # the catalog, not the workers: next pass
            log.warning("deployment %s/%s: %s: %s (next pass)", deployment.workspace,
                        deployment.name, type(exc).__name__, exc)  # fmt: skip
            return None

    async def _poll(self, deployment: Deployment, observed: Observed) -> S:
        if observed.failed:
            await _backend(self.backend.stop(deployment.workspace, deployment.name))
            await self._set(deployment, S.ERROR, observed.message)
            return S.ERROR
        status = S.READY if observed.all_ready or deployment.status is S.READY else S.PENDING
        await self._set(deployment, status, observed.message)
        return status

    async def _set(self, deployment: Deployment, status: S, message: str) -> None:
        """Write the status if it changed; a deployment changed or deleted meanwhile is left
        to the next pass."""
        if (deployment.status, deployment.status_message) == (status, message):
            return
        changes = {"status": status.value, "status_message": message}
        try:
            await self.calls.update(
                DEPLOYMENTS, deployment.workspace, deployment.name, changes, deployment.version
            )
        except (ConflictError, NotFoundError) as exc:
            log.info("deployment %s: %s (next pass)", deployment.name, exc.message)
            return
        log.info(
            "deployment %s/%s: %s (%s)", deployment.workspace, deployment.name, status, message
        )

    async def _collect(self, deployment: Deployment) -> None:
        """Delete a DELETED or ERROR deployment unchanged for `ttl` seconds."""
        if (self.now() - deployment.updated_at).total_seconds() < self.ttl:
            return
        try:
            await self.calls.delete(
                DEPLOYMENTS, deployment.workspace, deployment.name, deployment.version
            )
        except (ConflictError, NotFoundError):
            return
        log.info("deployment %s/%s collected", deployment.workspace, deployment.name)

    async def _providers(self, workspace: str, ready: list[Deployment], unjudged: set[str]) -> bool:
        """Each READY deployment has its fleet provider; other deployment providers go (not
        those of `unjudged` deployments: unreadable, or left as they are this pass). True if
        deployment providers are left."""
        providers = {p.name: p for p in await self.calls.list_all(PROVIDERS, workspace)}
        for deployment in ready:
            await self._ensure_provider(workspace, deployment, providers)
        wanted = {fleet_provider_name(d) for d in {d.name for d in ready} | unjudged}
        stale = [
            p for name, p in providers.items()
            if p.autoprovisioned and name.startswith(PROVIDER_PREFIX) and name not in wanted
        ]  # fmt: skip
        if not stale:
            return bool(ready)
        cache = EntityCache(self.calls, workspace)
        await cache.refresh()
        try:
            for provider in stale:
                ref = f"{workspace}/{provider.name}"
                for name in cache.linked_to(ref):
                    cache.stage_provider_unlink(name, ref)
        finally:
            await cache.flush()
        left = bool(ready)
        for provider in stale:
            try:
                await self.calls.delete(PROVIDERS, workspace, provider.name, provider.version)
            except (ConflictError, NotFoundError):
                left = True  # changed meanwhile: looked at again next pass
        return left

    async def _ensure_provider(
        self, workspace: str, deployment: Deployment, providers: dict[str, Provider]
    ) -> None:
        body = fleet_provider(deployment)
        held = providers.get(body["name"])
        try:
            if held is None:
                await self.calls.create(PROVIDERS, workspace, body)
                return
            current = held.model_dump(mode="json")
            changes = {k: v for k, v in body.items() if k != "name" and current.get(k) != v}
            if changes:
                await self.calls.update(PROVIDERS, workspace, held.name, changes, held.version)
        except CatalogError as exc:  # a name taken by a user, or changed meanwhile
            log.warning("provider %s/%s of deployment %s: %s",
                        workspace, body["name"], deployment.name, exc.message)  # fmt: skip
