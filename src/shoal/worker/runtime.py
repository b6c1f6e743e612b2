"""`Runtime`: a worker process's hold on the fleet: store, lease, endpoints, status server.

The runtime owns the process lease; every key it writes (endpoint instances, model cards)
is put under it, and the lease id is the instance id. Two control loops keep the store
true to the process:

- `lease`: renews the lease every TTL/3 (`LeaseKeeper.tick`). When the lease was lost (a
  store outage longer than the TTL) it grants a new one and re-registers every endpoint
  instance, model and metadata owner under the new id, without a restart.
- `models`: keeps each endpoint's announced models in step with its engine's
  `served_models()` (an upstream going down withdraws its models).

Drain (`drain()`, on SIGTERM): taint every model `draining`, let in-flight requests
finish (up to the drain timeout; a second signal ends the wait), cut what is left, detach
(discovery first, then metadata), revoke the lease; the store calls share `CLEANUP_BUDGET`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import time
from collections.abc import Awaitable, Coroutine, Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shoal.cards import ModelCard
from shoal.controllers import Controller, ControllerManager, Loop
from shoal.discovery import Discovery, EndpointId, ModelKey
from shoal.store import Lease, LeaseKeeper, Store, StoreError, open_store
from shoal.worker.endpoint import Attached, Endpoint
from shoal.worker.metadata import MetadataKey, MetadataRegistry
from shoal.worker.status import StatusServer

log = logging.getLogger(__name__)

DRAINING = "draining"
CLEANUP_BUDGET = 2.0
"""Seconds a drain may spend past its timeout on the store: every store call of the drain
(taints, withdrawals, revoke, close) shares it, so a frozen store delays exit by this much
at most. Stopping the servers adds about `2 * SHUTDOWN_GRACE`."""
MODELS_INTERVAL = 1.0
"""Seconds between two checks of what each engine serves."""

LOOP_STOP_TIMEOUT = 0.2
"""Seconds a control loop's step gets to finish when the drain stops it, before it is cut."""

_STORE_ERRORS = (StoreError, OSError, TimeoutError)


class _CleanupBudget:
    """The seconds a drain's store calls share: each gets what the ones before it left."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.cut_short = False  # a call was abandoned (or skipped) when the budget ran out

    async def spend(self, what: str, call: Coroutine[Any, Any, object]) -> None:
        """Run `call` until it ends or the budget does; a failure is logged, not raised."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            call.close()
            self.cut_short = True
            log.warning("drain: skipped %s: the %.1fs cleanup budget is spent", what, self.seconds)
            return
        try:
            async with asyncio.timeout(remaining):
                await call
        except TimeoutError:
            self.cut_short = True
            log.warning(
                "drain: %s did not finish within the %.1fs cleanup budget", what, self.seconds
            )
        except _STORE_ERRORS as exc:
            log.warning("drain: %s failed: %s", what, exc)


class Runtime:
    """Connects to the store, holds the process lease, serves endpoints and the status server.

    Use as `async with Runtime(store_url) as runtime:`, or `await start()` / `await drain()`.
    `store` is a URL (the runtime opens and closes it) or an open `Store` (left open).
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
        self.endpoints: dict[EndpointId, Endpoint] = {}
        self.metadata = MetadataRegistry()
        self.registry = CollectorRegistry()
        self.registry.register(_RuntimeCollector(self))
        self.manager = ControllerManager()
        self.draining = False
        self.stopped = asyncio.Event()
        self.cleanup_cut_short = False
        """Set by a drain that gave up on a store call: its keys expire with the lease."""
        self._keeper: LeaseKeeper | None = None
        self._lease_control: _LeaseControl | None = None
        self._models_control = _ModelsControl()
        self._registered_lease: int | None = None  # the lease everything is registered under
        self._pending_deletes: dict[str, int] = {}  # key -> lease it was put under
        self._lock = asyncio.Lock()  # serialises writes of registrations to the store
        self._status: StatusServer | None = None
        self._stop_requested = asyncio.Event()
        self._hurry = asyncio.Event()  # a second stop request: stop waiting for requests
        self._started = False
        self._signals_installed = False

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> Runtime:
        """Open the store, grant the lease, start the lease loop and the status server.

        Raises `StoreUnavailableError` if the store cannot be reached; then nothing is left
        running.
        """
        if self._started:
            return self
        if self.store is None:
            url = self._store_arg if isinstance(self._store_arg, str) else None
            self.store = await open_store(url)
        self.discovery = Discovery(self.store)
        self._keeper = LeaseKeeper(self.store, self.lease_ttl, self._on_granted)
        self._lease_control = _LeaseControl(self)
        self._status = StatusServer(self)
        try:
            await self._keeper.start()
            await self._status.start(self.host, self.status_port)
        except BaseException:
            await self._status.stop()
            if not isinstance(self._store_arg, Store):
                await self.store.close()
                self.store = None
            raise
        self.manager.register(
            Loop(
                self._lease_control,
                interval=self._keeper.interval,
                name="lease",
                max_silence=self.lease_ttl,
            )
        )
        self.manager.register(Loop(self._models_control, interval=MODELS_INTERVAL, name="models"))
        await self.manager.start_all()
        self._started = True
        return self

    async def __aenter__(self) -> Runtime:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    @property
    def lease(self) -> Lease:
        if self._keeper is None or self._keeper.lease is None:
            raise RuntimeError("the runtime is not started")
        return self._keeper.lease

    @property
    def instance_id(self) -> int:
        """The id of the current lease: this process's endpoint instance id."""
        return self.lease.id

    @property
    def status_url(self) -> str:
        if self._status is None or self._status.url is None:
            raise RuntimeError("the runtime is not started")
        return self._status.url

    def endpoint(self, name: str | EndpointId) -> Endpoint:
        """The endpoint `namespace.component.endpoint` of this process; serve an engine on it."""
        endpoint_id = name if isinstance(name, EndpointId) else EndpointId.parse(name)
        if endpoint_id not in self.endpoints:
            self.endpoints[endpoint_id] = Endpoint(self, endpoint_id)
        return self.endpoints[endpoint_id]

    def request_stop(self) -> None:
        """Ask `run_until_stopped` to drain and return (what SIGTERM and SIGINT do).

        A second request during the drain stops waiting for in-flight requests (they are
        cut); the withdrawals and the lease revoke still run, within `CLEANUP_BUDGET`.
        """
        if self._stop_requested.is_set() and not self._hurry.is_set():
            log.warning("second stop request: cutting in-flight requests, then withdrawing")
            self._hurry.set()
        self._stop_requested.set()

    def install_signal_handlers(self) -> None:
        """Make SIGTERM and SIGINT call `request_stop()` (idempotent); do it before announcing.

        They stay installed until the drain is over, so a second signal shortens the drain
        instead of killing the process with its keys still in the store.
        """
        if not self._signals_installed:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            self._signals_installed = True

    def _remove_signal_handlers(self) -> None:
        if self._signals_installed:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
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
        """Serve until SIGTERM/SIGINT (or `request_stop()`), then drain."""
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
        """Taint `draining`, wait for in-flight requests (up to `timeout`), detach, revoke, stop.

        Takes at most `timeout` plus `CLEANUP_BUDGET` (plus a fraction of a second to stop
        the servers), whatever the store does.
        """
        if self.stopped.is_set() or self.draining:
            await self.stopped.wait()
            return
        self.draining = True
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
        for ep in serving:
            await budget.spend(f"tainting {ep.id} draining", ep.set_taints([DRAINING]))
        await self._wait_idle(serving, timeout)
        for ep in serving:
            await ep.stop_serving()  # cuts what is still in flight
        await self.manager.stop_all(timeout=LOOP_STOP_TIMEOUT)
        for ep in serving:
            await budget.spend(f"withdrawing {ep.id}", ep.withdraw())
        if self._keeper is not None:
            await budget.spend("revoking the lease", self._keeper.revoke())
        if self._status is not None:
            await self._status.stop()
        if self.store is not None and not isinstance(self._store_arg, Store):
            await budget.spend("closing the store", self.store.close())
        self.cleanup_cut_short = budget.cut_short

    async def _wait_idle(self, endpoints: list[Endpoint], timeout: float) -> None:
        """Wait until no request is in flight on any of `endpoints`, at most `timeout` seconds
        (less if a second stop is requested)."""
        deadline = time.monotonic() + timeout
        hurry = asyncio.ensure_future(self._hurry.wait())
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

    # -- health -------------------------------------------------------------------------

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy when every endpoint serves, the engines answer and the lease is held."""
        reasons: list[str] = []
        if self.draining:
            reasons.append("draining")
        reasons.extend(f"loop {name}: {why}" for name, why in self.manager.unhealthy().items())
        lease_reason = self.lease_problem()
        if lease_reason:
            reasons.append(lease_reason)
        endpoints = []
        for ep in self.endpoints.values():
            if not ep.serving or ep.engine is None:
                reasons.append(f"endpoint {ep.id} is not serving")
                continue
            try:
                await asyncio.wait_for(ep.engine.check_health(), 5.0)
            except Exception as exc:
                reasons.append(f"endpoint {ep.id}: engine {ep.engine.name} unhealthy: {exc}")
            endpoints.append(
                {
                    "endpoint": str(ep.id),
                    "url": ep.url,
                    "in_flight": ep.in_flight,
                    "models": [
                        {
                            "name": att.card.display_name,
                            "suffix": suffix,
                            "mdcsum": att.card.mdcsum,
                            "taints": list(att.card.taints),
                        }
                        for suffix, att in ep.models.items()
                    ],
                }
            )
        lease = self._keeper.lease if self._keeper else None
        body = {
            "status": "unavailable" if reasons else "ok",
            "reasons": reasons,
            "instance_id": None if lease is None else f"{lease.id:x}",
            "endpoints": endpoints,
        }
        return not reasons, body

    def lease_problem(self) -> str | None:
        """Why the lease is not held (with everything registered under it), or None."""
        keeper = self._keeper
        if keeper is None or keeper.lease is None:
            return "no lease"
        error = self._lease_control.error if self._lease_control else None
        if not keeper.held:
            return f"lease {keeper.lease.id:x} lost" + (f": {error}" if error else "")
        silence = time.monotonic() - keeper.lease.last_renewed
        if silence > keeper.ttl:
            return f"lease {keeper.lease.id:x} not renewed for {silence:.1f}s" + (
                f": {error}" if error else ""
            )
        if self._registered_lease != keeper.lease.id:
            return f"registering under the new lease {keeper.lease.id:x}"
        return None

    # -- registrations (under the lock, always under the current lease) -----------------

    async def register_instance(self, ep: Endpoint) -> None:
        async with self._lock:
            if self._registered_lease == self.lease.id:
                await self.discovery.register_instance(
                    ep.instance_info(self.lease.id), lease=self.lease.id
                )

    async def unregister_instance(self, ep: Endpoint) -> None:
        async with self._lock:
            await self.discovery.unregister_instance(ep.id, self.lease.id)

    async def attach(
        self, ep: Endpoint, card: ModelCard, suffix: str | None, files: dict[str, bytes]
    ) -> None:
        async with self._lock:
            lease_id = self.lease.id
            key = ModelKey(ep.id, lease_id, suffix)
            previous = ep.models.get(suffix)
            if previous is not None:
                self.metadata.reassign(previous.key, key)
            before = self.metadata.files_of(key)
            if self.draining:
                card = card.with_taints([*card.taints, DRAINING])
            entries = [(MetadataKey.of(ep.id, card.slug, suffix, n), d) for n, d in files.items()]
            self.metadata.replace(key, entries)  # files first: the card points at them
            self._pending_deletes.pop(key.key, None)
            try:
                await self.discovery.register_model(key, card, lease=lease_id)
            except BaseException:
                self.metadata.replace(key, before)
                raise
            ep.models[suffix] = Attached(key, card, dict(files))

    async def detach(self, ep: Endpoint, suffix: str | None) -> None:
        async with self._lock:
            att = ep.models.pop(suffix, None)
            if att is None:
                return
            try:
                await self.discovery.unregister_model(att.key)
            except _STORE_ERRORS as exc:
                # The key vanishes with its lease if that is lost; else the lease loop retries.
                log.warning("withdrawing %s failed (will retry): %s", att.key, exc)
                self._pending_deletes[att.key.key] = att.key.instance_id
            finally:
                self.metadata.unregister_for_owner(att.key)

    async def set_taints(self, ep: Endpoint, taints: list[str]) -> None:
        async with self._lock:
            for att in ep.models.values():
                att.card = att.card.with_taints(taints)
                with contextlib.suppress(KeyError):
                    await self.discovery.update_taints(att.key, taints)

    def watch_models(self, ep: Endpoint) -> None:
        """Keep `ep`'s models in step with its engine from now on."""
        self._models_control.endpoints.add(ep)

    async def _on_granted(self, lease: Lease) -> None:
        """A new lease: re-register everything this process owns under its id."""
        old = self._registered_lease
        if old is not None and old != lease.id:
            log.warning("lease %x replaced by %x: re-registering", old, lease.id)
        await self._register_all(lease)

    async def _register_all(self, lease: Lease) -> None:
        async with self._lock:
            old = self._registered_lease
            if old is not None and old != lease.id:
                self._pending_deletes.clear()
                with contextlib.suppress(*_STORE_ERRORS):
                    await self.store_or_fail().revoke(old)  # in case it was only lost to us
            for ep in self.endpoints.values():
                if not ep.serving:
                    continue
                await self.discovery.register_instance(ep.instance_info(lease.id), lease=lease.id)
                for suffix, att in ep.models.items():
                    key = ModelKey(ep.id, lease.id, suffix)
                    self.metadata.reassign(att.key, key)
                    att.key = key
                    await self.discovery.register_model(key, att.card, lease=lease.id)
            self._registered_lease = lease.id

    async def _reconcile(self) -> None:
        """After a successful renewal: finish a re-registration, retry failed withdrawals."""
        lease = self.lease
        if self._registered_lease != lease.id:
            await self._register_all(lease)
        if self._pending_deletes:
            async with self._lock:
                for key, lease_id in list(self._pending_deletes.items()):
                    if lease_id == lease.id:
                        await self.store_or_fail().delete(key)
                    del self._pending_deletes[key]

    def store_or_fail(self) -> Store:
        if self.store is None:
            raise RuntimeError("the runtime is not started")
        return self.store


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or `localhost`) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve to anything: not loopback


class _LeaseControl(Controller):
    """The lease loop's step: renew (or replace) the lease, then reconcile registrations."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.error: str | None = None

    async def step(self) -> None:
        keeper = self.runtime._keeper
        assert keeper is not None
        try:
            await keeper.tick()
            await self.runtime._reconcile()
        except _STORE_ERRORS as exc:
            if self.error is None:
                log.warning("store unreachable: %s (serving on; will re-register)", exc)
            self.error = str(exc) or type(exc).__name__
            return
        if self.error is not None:
            log.info("store reachable again; lease %x held", keeper.lease.id if keeper.lease else 0)
        self.error = None

    @property
    def is_healthy(self) -> bool:
        return self.runtime.lease_problem() is None


class _ModelsControl(Controller):
    """The models loop's step: each endpoint's announced models follow its engine."""

    def __init__(self) -> None:
        self.endpoints: set[Endpoint] = set()
        self.errors: dict[Endpoint, str] = {}  # last failure per endpoint, logged once

    async def step(self) -> None:
        for ep in list(self.endpoints):
            if not ep.serving:
                self.endpoints.discard(ep)
                continue
            try:
                await ep.sync_models()
            except Exception as exc:  # the store or the engine: try again next step
                if str(exc) != self.errors.get(ep):
                    log.warning("endpoint %s: model sync failed: %s", ep.id, exc)
                self.errors[ep] = str(exc)
            else:
                self.errors.pop(ep, None)


class _RuntimeCollector:
    """The runtime's metrics and its engines', built at each scrape from plain counters."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterable[Metric]:
        rt = self.runtime
        requests = CounterMetricFamily(
            "shoal_worker_requests",
            "Requests served, by endpoint, route and status.",
            labels=["endpoint", "route", "status"],
        )
        in_flight = GaugeMetricFamily(
            "shoal_worker_requests_in_flight", "Requests being served.", labels=["endpoint"]
        )
        models = GaugeMetricFamily(
            "shoal_worker_models_attached", "Models announced in discovery.", labels=["endpoint"]
        )
        engine_metrics: dict[str, Metric] = {}
        for ep in rt.endpoints.values():
            name = str(ep.id)
            for (route, status), n in ep.requests.items():
                requests.add_metric([name, route, str(status)], n)
            in_flight.add_metric([name], ep.in_flight)
            models.add_metric([name], len(ep.models))
            if ep.engine is not None:
                for metric in ep.engine.collect_metrics():
                    merged = engine_metrics.setdefault(
                        metric.name, Metric(metric.name, metric.documentation, metric.type)
                    )
                    merged.samples.extend(
                        s._replace(labels={**s.labels, "endpoint": name}) for s in metric.samples
                    )
        yield requests
        yield in_flight
        yield models
        keeper = rt._keeper
        yield GaugeMetricFamily(
            "shoal_worker_lease_held",
            "1 while the process lease is held with everything registered under it.",
            value=1 if rt.lease_problem() is None else 0,
        )
        yield CounterMetricFamily(
            "shoal_worker_lease_grants",
            "Leases granted to this process (more than 1: the lease was lost and replaced).",
            value=keeper.grants if keeper else 0,
        )
        yield GaugeMetricFamily(
            "shoal_worker_metadata_files", "Metadata files hosted.", value=len(rt.metadata)
        )
        yield GaugeMetricFamily(
            "shoal_worker_draining", "1 while draining.", value=1 if rt.draining else 0
        )
        yield from engine_metrics.values()
