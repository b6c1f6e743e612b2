"""`Runtime`: a worker process's hold on the fleet: store, lease, endpoints, status server.

The runtime owns what the process shares: the store, its `Registrations` (the process
lease and every key put under it; the lease id is the instance id), the metadata registry,
the metrics registry and the status server; it starts and stops them. Two control loops,
both started in `start()`, keep the store true to the process:

- `lease`: renews the lease every TTL/3 (`Registrations.renew`). When the lease was lost (a
  store outage longer than the TTL) it grants a new one and re-registers every endpoint
  instance, model and metadata owner under the new id, without a restart.
- `models`: keeps each endpoint's announced models in step with its engine's
  `served_models()` (an upstream going down withdraws its models).

Drain (`drain()`, on SIGTERM): let in-flight requests finish (up to the drain timeout; a
second signal ends the wait), tainting every model `draining` meanwhile, cut what is left,
detach (discovery first, then metadata), revoke the lease. Its store calls share
`CLEANUP_BUDGET`, of which `REVOKE_RESERVE` is the revoke's; the taint is the wait's, never
the budget's. With more than `WITHDRAW_ONE_BY_ONE` models the revoke is their withdrawal
from discovery (one call, not one per model).
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import signal
import time
from collections.abc import Awaitable, Coroutine, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from shoal.controllers import Controller, ControllerManager, HeartbeatMixin, Loop
from shoal.discovery import Discovery, EndpointId
from shoal.store import Lease, Store, open_store
from shoal.worker.adapters import AdapterRoutes
from shoal.worker.endpoint import Endpoint
from shoal.worker.health import Health
from shoal.worker.metadata import MetadataRegistry
from shoal.worker.metrics import WorkerCollector
from shoal.worker.registrations import DRAINING, STORE_ERRORS, Registrations
from shoal.worker.status import StatusServer

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that drain: SIGHUP too (a closed terminal, a lost ssh session), which would
otherwise kill the process with its cards announced until its lease runs out."""

log = logging.getLogger(__name__)

CLEANUP_BUDGET = 2.0
"""Seconds a drain may spend past its timeout on the store: its store calls but the taint
(ending replaced leases, withdrawals, revoke, close) share it, so a frozen store delays exit
by this much at most. Stopping the servers adds about `2 * SHUTDOWN_GRACE`."""
REVOKE_RESERVE = 1.5
"""Seconds of `CLEANUP_BUDGET` kept for the lease revoke (which alone deletes every key of
the process): the calls before it never spend them. A revoke of 20,002 keys takes 0.4 s on
an idle SQLite file, twice that on a busy one; with 0.5 s kept, and the taint spending the
rest, it was cut and a worker in front of 20,001 models left them all in the store."""
TAINT_TRY = 1.0
"""Seconds one try at tainting an endpoint `draining` gets while the drain waits; one the
store refused or did not finish is tried again after the rest of them (a try goes on where
the one before stopped)."""
WITHDRAW_ONE_BY_ONE = 32
"""Models a drain withdraws one store call each before the revoke; with more, the revoke
withdraws them all in one call (discovery first), then their metadata files go."""
MODELS_INTERVAL = 1.0
"""Seconds between two checks of what each engine serves."""
MODELS_SILENCE = 15.0
"""Seconds the models loop may spend on one endpoint before it counts as stuck: an engine
may be slow to say what it serves (the openai sidecar asks its upstream, two GETs of up to
5 s each), and slow is not stuck. At three intervals (3 s), an upstream answering each GET
in 1.6 s made the worker's `/health` 503 a third of the time."""

FREEZE_AFTER = 1024
"""Models attached or detached since the garbage collector last had what the process holds
frozen out of its full passes (`freeze_collector`), after which it is frozen again."""

LOOP_STOP_TIMEOUT = 0.2
"""Seconds a control loop's step gets to finish when the drain stops it, before it is cut."""


class _CleanupBudget:
    """The seconds a drain's store calls share: each gets what the ones before it left.

    Only the time spent in those calls counts, not the wait for requests in flight between
    them: a drain that waited its whole `--drain-timeout` still has its budget to withdraw.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.left = seconds
        self.cut_short = False  # a call was abandoned (or skipped) when the budget ran out

    async def spend(
        self, what: str, call: Coroutine[Any, Any, object], *, keep: float = 0.0
    ) -> bool:
        """Run `call` until it ends or the budget does (but for `keep` seconds, kept for
        the calls after it); True if it succeeded. A failure is logged, not raised."""
        if self.left - keep <= 0:
            call.close()
            self.cut_short = True
            log.warning("drain: skipped %s: the %.1fs cleanup budget is spent", what, self.seconds)
            return False
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.left - keep):
                await call
            return True
        except TimeoutError:
            self.cut_short = True
            log.warning(
                "drain: %s did not finish within the %.1fs cleanup budget", what, self.seconds
            )
        except STORE_ERRORS as exc:
            log.warning("drain: %s failed: %s", what, exc)
        finally:
            self.left -= time.monotonic() - started
        return False


class Runtime:
    """Connects to the store, holds the process lease, serves endpoints and the status server.

    Use as `async with Runtime(store_url) as runtime:`, or `await start()` / `await drain()`.
    `store` is a URL (the runtime opens and closes it) or an open `Store` (left open).

    `instance_id` is the id of the lease held now. Everything the endpoints announce is in
    `registrations`, and in the store under `instance_id` once `registrations.lease_id`
    equals it; a lost lease is replaced and everything re-put under the new id by the lease
    loop, so `instance_id` changes and nothing restarts. After `drain()` the process has
    withdrawn what it announced and revoked its lease (a store call the cleanup budget could
    not cover leaves keys that expire with the lease). `metrics_registry` is the process's
    own Prometheus registry.
    """

    discovery: Discovery

    def __init__(
        self,
        store: Store | str | None = None,
        *,
        lease_ttl: float = 10.0,
        host: str = "127.0.0.1",
        status_port: int = 0,
        admin_token: str | None = None,
        drain_timeout: float = 30.0,
        freeze_collector: bool = False,
    ) -> None:
        if lease_ttl <= 0:
            raise ValueError(f"lease_ttl must be positive, got {lease_ttl}")
        if not admin_token and not is_loopback(host):
            raise ValueError(
                f"the status server on {host}, not a loopback address, would let anyone who "
                "reaches it load adapters from any path: set an admin token "
                "(--admin-token or SHOAL_ADMIN_TOKEN), or serve on 127.0.0.1"
            )
        self._store_arg = store
        self.store: Store | None = store if isinstance(store, Store) else None
        self.lease_ttl = lease_ttl
        self.host = host
        self.status_port = status_port
        self.admin_token = admin_token
        self.drain_timeout = drain_timeout
        self.freeze_collector = freeze_collector
        self.endpoints: dict[EndpointId, Endpoint] = {}
        self.metadata = MetadataRegistry()
        self.metrics_registry = CollectorRegistry()
        self.manager = ControllerManager()
        self.stopped = asyncio.Event()
        self.cleanup_cut_short = False
        """Set by a drain that gave up on a store call: its keys expire with the lease."""
        self._registrations: Registrations | None = None
        self._status: StatusServer | None = None
        self._draining = asyncio.Event()  # set when the drain begins; never cleared
        self._stop_requested = asyncio.Event()
        self._hurry = asyncio.Event()  # a second stop request: stop waiting for requests
        self._started = False
        self._signals_installed = False

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> Runtime:
        """Open the store, grant the lease, start the status server and the control loops.

        Raises `StoreUnavailableError` if the store cannot be reached; then nothing is left
        running.
        """
        if self._started:
            return self
        if self.store is None:
            url = self._store_arg if isinstance(self._store_arg, str) else None
            self.store = await open_store(url)
        registrations = Registrations(
            self.store, self.metadata, lease_ttl=self.lease_ttl, draining=self._draining
        )
        self.discovery = registrations.discovery
        self._registrations = registrations
        collector = WorkerCollector(self.endpoints, registrations, self.metadata, self._draining)
        self.metrics_registry.register(collector)
        self._status = StatusServer(
            Health(self.endpoints, self.manager, registrations, self._draining),
            self.metrics_registry,
            self.metadata,
            AdapterRoutes(self.endpoints, admin_token=self.admin_token, draining=self._draining),
        )
        try:
            await registrations.start()
            await self._status.start(self.host, self.status_port)
        except BaseException:
            await self._status.stop()
            self.metrics_registry.unregister(collector)
            if not isinstance(self._store_arg, Store):
                await self.store.close()
                self.store = None
            raise
        freezer = _Freezer(registrations) if self.freeze_collector else None
        lease = _LeaseControl(registrations, freezer)
        interval = registrations.renew_interval
        self.manager.register(
            Loop(lease, interval=interval, name="lease", max_silence=self.lease_ttl)
        )
        models = _ModelsControl(self.endpoints, freezer)
        self.manager.register(
            Loop(models, interval=MODELS_INTERVAL, name="models", max_silence=MODELS_SILENCE)
        )
        await self.manager.start_all()
        self._started = True
        return self

    async def __aenter__(self) -> Runtime:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    @property
    def registrations(self) -> Registrations:
        """The endpoint instances and models this process announces, under its lease."""
        if self._registrations is None:
            raise RuntimeError("the runtime is not started")
        return self._registrations

    @property
    def lease(self) -> Lease:
        """The process lease held now; every key the process writes is under it."""
        lease = self.registrations.lease
        if lease is None:
            raise RuntimeError("the runtime is not started")
        return lease

    @property
    def instance_id(self) -> int:
        """The id of the current lease: this process's endpoint instance id."""
        return self.lease.id

    @property
    def status_url(self) -> str:
        if self._status is None or self._status.url is None:
            raise RuntimeError("the runtime is not started")
        return self._status.url

    @property
    def draining(self) -> bool:
        """True from the start of the drain on."""
        return self._draining.is_set()

    def endpoint(self, name: str | EndpointId) -> Endpoint:
        """The endpoint `namespace.component.endpoint` of this process; serve an engine on it.

        Raises `RuntimeError` before `start()`: an endpoint announces under the lease.
        """
        endpoint_id = name if isinstance(name, EndpointId) else EndpointId.parse(name)
        if endpoint_id not in self.endpoints:
            endpoint = Endpoint(endpoint_id, self.registrations, self.status_url)
            self.endpoints[endpoint_id] = endpoint
        return self.endpoints[endpoint_id]

    def request_stop(self) -> None:
        """Ask `run_until_stopped` to drain and return (what `STOP_SIGNALS` do).

        A second request during the drain stops waiting for in-flight requests (they are
        cut); the withdrawals and the lease revoke still run, within `CLEANUP_BUDGET`.
        """
        if self._stop_requested.is_set() and not self._hurry.is_set():
            log.warning("second stop request: cutting in-flight requests, then withdrawing")
            self._hurry.set()
        self._stop_requested.set()

    def install_signal_handlers(self) -> None:
        """Make `STOP_SIGNALS` call `request_stop()` (idempotent); do it before announcing.

        They stay installed until the drain is over, so a second signal shortens the drain
        instead of killing the process with its keys still in the store.
        """
        if not self._signals_installed:
            loop = asyncio.get_running_loop()
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, self.request_stop)
            self._signals_installed = True

    def _remove_signal_handlers(self) -> None:
        if self._signals_installed:
            loop = asyncio.get_running_loop()
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
            self._signals_installed = False

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    async def unless_stopped(self, step: Awaitable[object]) -> bool:
        """Await a start-up `step` unless a stop is requested first (then cancel it).

        True when `step` finished and no stop was requested: the caller may go on (and say
        it is ready). `step`'s exception is raised.
        """
        task = asyncio.ensure_future(step)
        stop = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait([task])
        if task.cancelled():
            return False
        task.result()
        return not self.stop_requested

    async def run_until_stopped(self) -> None:
        """Serve until a stop signal (or `request_stop()`), then drain."""
        self.install_signal_handlers()
        try:
            await self._stop_requested.wait()
            log.info("stop requested: draining (a second signal cuts in-flight requests)")
            await self.drain()
        finally:
            self._remove_signal_handlers()

    @property
    def in_flight(self) -> int:
        return sum(ep.in_flight for ep in self.endpoints.values())

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for in-flight requests (up to `timeout`; tainted `draining` meanwhile),
        detach, revoke, stop.

        Takes at most `timeout` plus `CLEANUP_BUDGET` (plus a fraction of a second to stop
        the servers), whatever the store does.
        """
        if self.stopped.is_set() or self.draining:
            await self.stopped.wait()
            return
        self._draining.set()
        timeout = self.drain_timeout if timeout is None else timeout
        try:
            if self._started:
                await self._drain(timeout)
        finally:
            self.stopped.set()

    async def _drain(self, timeout: float) -> None:
        budget = _CleanupBudget(CLEANUP_BUDGET)
        await self.manager.loops["models"].stop(timeout=LOOP_STOP_TIMEOUT)
        serving = [ep for ep in self.endpoints.values() if ep.serving]
        if self._registrations is not None:  # (copies under a replaced lease: not tainted)
            await budget.spend(
                "ending replaced leases",
                self._registrations.retire_replaced(),
                keep=REVOKE_RESERVE,
            )
        await self._wait_idle(serving, timeout)
        for ep in serving:
            await ep.stop_serving()  # cuts what is still in flight
        await self.manager.stop_all(timeout=LOOP_STOP_TIMEOUT)
        # Discovery first, then metadata. A few models are withdrawn one store call each;
        # more would not fit the budget, and the revoke deletes every key of the lease at
        # once anyway: then it is their withdrawal, and always gets its try.
        if sum(len(ep.models) for ep in serving) <= WITHDRAW_ONE_BY_ONE:
            for ep in serving:
                await budget.spend(f"withdrawing {ep.id}", ep.withdraw(), keep=REVOKE_RESERVE)
        if self._registrations is not None:
            await budget.spend("revoking the lease", self._registrations.revoke())
            for ep in serving:
                self._registrations.forget(ep.id)  # (their keys went with the lease)
        if self._status is not None:
            await self._status.stop()
        if self.store is not None and not isinstance(self._store_arg, Store):
            await budget.spend("closing the store", self.store.close())
        self.cleanup_cut_short = budget.cut_short

    async def _wait_idle(self, endpoints: list[Endpoint], timeout: float) -> None:
        """Wait until no request is in flight on any of `endpoints`, at most `timeout` seconds
        (less if a second stop is requested), tainting them `draining` meanwhile: until
        frontends see it, they keep sending. The taint is a courtesy to the requests waited
        for, cut when the wait ends: with none in flight there is no wait and no taint (the
        revoke comes at once), and it never spends the cleanup budget the revoke needs
        (20,001 cards took the 1.5 s it had and more; the revoke was cut)."""
        if all(ep.idle.is_set() for ep in endpoints):
            return
        deadline = time.monotonic() + timeout
        hurry = asyncio.ensure_future(self._hurry.wait())
        tainting = asyncio.ensure_future(self._taint(endpoints))
        try:
            while busy := [ep for ep in endpoints if not ep.idle.is_set()]:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or hurry.done():
                    why = "second stop request" if hurry.done() else "drain timeout"
                    log.warning("%s: cutting %d requests in flight", why, self.in_flight)
                    return
                idle = asyncio.ensure_future(busy[0].idle.wait())
                await asyncio.wait([idle, hurry], timeout=remaining, return_when="FIRST_COMPLETED")
                idle.cancel()
        finally:
            hurry.cancel()
            tainting.cancel()
            await asyncio.wait([tainting])  # (its store call let go before the revoke's)
            if not tainting.cancelled() and (exc := tainting.exception()) is not None:
                log.warning("drain: tainting draining failed: %r", exc)

    async def _taint(self, endpoints: list[Endpoint]) -> None:
        """Taint `endpoints` `draining`, each try within `TAINT_TRY` seconds; those the store
        refused (or a try did not finish) are tried again, after a pause of the rest of it."""
        while endpoints:
            started = time.monotonic()
            left = []
            for ep in endpoints:
                try:
                    async with asyncio.timeout(TAINT_TRY):
                        await ep.set_taints([DRAINING])
                except (TimeoutError, *STORE_ERRORS):
                    left.append(ep)
            if left:
                await asyncio.sleep(max(0.0, TAINT_TRY - (time.monotonic() - started)))
            endpoints = left


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or `localhost`) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve to anything: not loopback


class _Freezer:
    """Keeps what the process holds out of the garbage collector's full passes: once the
    models attached or detached since the last time (or the start) reach `FREEZE_AFTER`,
    and after a re-registration under a new lease, `gc.freeze()`. A full pass over a worker's 20,000
    models (~130,000 objects) held the event loop 90-210 ms each time allocations set one
    off; frozen, they are never scanned. They hold no reference cycle, so one detached later
    is freed all the same; a cycle that is garbage at the freeze stays (a process-wide
    setting: `shoal worker` sets it, a runtime embedded in another program's process not)."""

    def __init__(self, registrations: Registrations) -> None:
        self.registrations = registrations
        self.changes = 0
        self.lease_id = registrations.lease_id

    def after_step(self) -> None:
        changes, lease_id = self.registrations.models_changed, self.registrations.lease_id
        if changes - self.changes >= FREEZE_AFTER or lease_id != self.lease_id:
            gc.freeze()
            self.changes, self.lease_id = changes, lease_id


class _LeaseControl(Controller):
    """The lease loop's step: renew (or replace) the lease, then reconcile registrations."""

    def __init__(self, registrations: Registrations, freezer: _Freezer | None = None) -> None:
        self.registrations = registrations
        self.freezer = freezer

    async def step(self) -> None:
        await self.registrations.renew()
        if self.freezer is not None:
            self.freezer.after_step()

    @property
    def is_healthy(self) -> bool:
        return self.registrations.lease_problem() is None


class _ModelsControl(HeartbeatMixin, Controller):
    """The models loop's step: each endpoint that follows its engine announces what it serves
    (a heartbeat after each: the loop's silence is one endpoint's sync at most)."""

    def __init__(
        self, endpoints: Mapping[EndpointId, Endpoint], freezer: _Freezer | None = None
    ) -> None:
        self.endpoints = endpoints
        self.freezer = freezer
        self.errors: dict[Endpoint, str] = {}  # last failure per endpoint, logged once

    async def step(self) -> None:
        for ep in list(self.endpoints.values()):
            if not (ep.follows_engine and ep.serving):
                continue
            try:
                await ep.sync_models()
            except Exception as exc:  # the store or the engine: try again next step
                if str(exc) != self.errors.get(ep):
                    log.warning("endpoint %s: model sync failed: %s", ep.id, exc)
                self.errors[ep] = str(exc)
            else:
                self.errors.pop(ep, None)
            self.emit_heartbeat()
        if self.freezer is not None:
            self.freezer.after_step()
