"""`Frontend`: the gateway wired together: server, routes, registry, watcher, reconciliation.

Its routes and small handlers are `endpoints.py`'s, its settings `config.py`'s.

Virtual models (the routes of `workspaces`, see `virtual`) are served beside discovered
models: `Frontend.routes` is the table, `routes.describe()` its report (also in `/health`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from shoal import open_files
from shoal.controllers import ControllerManager, Loop, LoopCollector
from shoal.discovery import Discovery, Query
from shoal.frontend.config import (
    FrontendConfig,
    MembershipFollower,
    MembershipView,
    provider_tls,
    server_tls,
    url_host,
)
from shoal.frontend.dashboard.dashboard import Dashboard
from shoal.frontend.endpoints import Endpoints
from shoal.frontend.http.cors import Cors
from shoal.frontend.http.listener import HttpServer
from shoal.frontend.keys.gate import Gate
from shoal.frontend.keys.keys import KeyRing, KeyWatcher
from shoal.frontend.keys.limits import Limits
from shoal.frontend.keys.usage import UsageBook
from shoal.frontend.kv.router import KvRouter
from shoal.frontend.kv.stream import KvStreamReader
from shoal.frontend.listings import Listings
from shoal.frontend.proxy.disagg import TwoStages
from shoal.frontend.proxy.fields import stop_decoder
from shoal.frontend.proxy.proxy import Proxy
from shoal.frontend.registry.metadata import MetadataCache
from shoal.frontend.registry.metrics import FrontendMetrics
from shoal.frontend.registry.registry import Registry
from shoal.frontend.registry.router import make_router
from shoal.frontend.registry.watcher import ModelWatcher, Reconciler
from shoal.frontend.virtual.routes import RouteWatcher
from shoal.frontend.virtual.secrets import Secrets
from shoal.frontend.virtual.virtual import RouteTable
from shoal.store import Store, StoreUnavailableError, default_store_url, open_store

log = logging.getLogger(__name__)
RECONCILER = "model-reconciler"
RECONCILE_RETRY = 2.0
"""Seconds after a failed reconciliation pass before the next, doubling to the interval."""
LOAD_PROGRESS_SECONDS = 10.0  # a large scope loading: how far it got, said this often


class Frontend(Endpoints):
    """One OpenAI-compatible gateway process (or an in-process one, in tests and `shoal up`).

    Pass `discovery` to use a ready `Discovery` (tests wrap one to drop events); otherwise
    the store at `config.store_url` is opened on `start()` and closed on `stop()`.
    """

    def __init__(
        self,
        config: FrontendConfig | None = None,
        *,
        discovery: Discovery | None = None,
        membership: Callable[[Discovery], MembershipFollower] | None = None,
    ) -> None:
        self.config = config = config or FrontendConfig()
        self.discovery = discovery
        self._membership_factory = membership
        self.membership: MembershipFollower | None = None
        self._followed: Mapping[str, tuple[Query, ...]] | None = None  # the scopes in force
        self.scope_loaded = False  # (with a membership) its first scope listed: see `start`
        self._own_store: Store | None = None
        self.metrics = FrontendMetrics()
        self.registry = Registry(connect_timeout=config.connect_timeout)
        self.router = KvRouter() if config.router == "kv" else make_router(config.router)
        if isinstance(self.router, KvRouter):
            self.router.overlap_weight = config.kv_overlap_weight
        self.routes = RouteTable(
            self.registry,
            config.workspaces,
            secrets=Secrets(config.secrets_dir),
            connect_timeout=config.connect_timeout,
        )
        self.route_watcher: RouteWatcher | None = None
        # (virtual models count as models: their request series are not dropped as departed)
        self.metrics.live_instances = self._live_instances
        self.proxy = Proxy(
            self.registry,
            self.router,
            self.metrics,
            retries=config.retries,
            inhibit_seconds=config.inhibit_seconds,
            first_byte_timeout=config.first_byte_timeout,
            upstream_idle_timeout=config.upstream_idle_timeout,
            migration_limit=config.migration_limit,
            strip_authorization=bool(config.api_keys) or config.auth == "keys",
            routes=self.routes,
        )
        self.proxy.two_stages = TwoStages(self.proxy)  # models served disaggregated
        self.proxy.loaded = self._fleet_loaded
        self._keys = tuple(key.encode() for key in config.api_keys)
        self.keys: KeyRing | None = None
        if config.auth == "keys":
            self.keys = KeyRing(config.workspaces, config.key_pepper, self._keys)
        self.key_watcher: KeyWatcher | None = None
        self.limits = Limits(config.limits_url)
        self.usage: UsageBook | None = None
        if config.catalog_url and config.auth == "keys":
            self.usage = UsageBook(
                config.catalog_url, token=config.catalog_token, interval=config.usage_interval
            )
        record = self.usage.record if self.usage is not None else None
        self.gate = Gate(self.limits, self.proxy.handle, record)
        self.cors = Cors(config.cors_origins) if config.cors_origins else None
        self.manager = ControllerManager()
        self.metrics.registry.register(LoopCollector(self.manager))
        self.dashboard = Dashboard(self)
        self.dashboard.reader.routes = lambda: self.routes.describe()["models"]
        self.watcher: ModelWatcher | None = None
        self._loading: asyncio.Task[None] | None = None  # the first discovery snapshot
        self._lag: asyncio.Task[None] | None = None  # samples the event loop's lag
        self.reconciler: Reconciler | None = None
        self.server: HttpServer | None = None
        self.metrics_server: HttpServer | None = None  # `/metrics` alone, on `metrics_port`
        self._tls: ssl.SSLContext | None = None
        # One process of several: `/metrics` on the API port answers the whole frontend's.
        self.metrics_source: Callable[[], Awaitable[bytes | list[bytes]]] | None = None
        self.draining = False
        self.started_at = time.time()
        self.listings = Listings(self.registry, self.routes, self._fleet_loaded)
        self._health_body: tuple[int, dict[str, Any]] | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls_certfile is not None else "http"
        return f"{scheme}://{url_host(self.config.host)}:{self.port}"

    async def start(self) -> None:
        """Serve at once (health says 503 until the first snapshot), then load discovery,
        then put the first membership selection in force (when the scope follows one) and
        apply the first listing of each of its namespaces: not ready, and not on a shared
        port, with a registry that lists only some of them.

        `StoreUnavailableError`, naming the store, if it does not answer the first listing
        within `setup_timeout` seconds (the fleet it lists then loads as long as its size
        needs, its progress in `/health` and the log); the membership's `MembershipError`
        (its own bound of the same length) naming why its first selection is not in force;
        outages after that are survived.
        """
        config = self.config
        try:
            try:
                async with asyncio.timeout(config.setup_timeout):
                    await self._set_up()
            except TimeoutError:
                url = config.store_url or (
                    self.discovery.store.url if self.discovery is not None else default_store_url()
                )
                raise StoreUnavailableError(
                    f"store {url} did not answer within {config.setup_timeout:g}s "
                    "(--setup-timeout); is it running and reachable?"
                ) from None
            # The store answered: loading the fleet it listed takes as long as its size
            # needs (`/health` and the log tell the progress); not ready until it is loaded.
            assert self._loading is not None
            await self._loading
        except BaseException:
            if self._loading is not None:
                self._loading.cancel()
                await asyncio.gather(self._loading, return_exceptions=True)
            raise
        assert self.watcher is not None and self.discovery is not None
        if self._membership_factory is not None:
            # Bounded by the membership's own setup timeout, not the store's above: its
            # error (a bad sources file, a namespace not opened) is the one reported.
            await self._follow_membership(self._membership_factory(self.discovery))
            await self._load_scope()
        self.reconciler = Reconciler(self.watcher)
        reconciling = Loop(
            self.reconciler,
            interval=config.reconcile_interval,
            name=RECONCILER,
            retry=RECONCILE_RETRY,  # (a failed listing: the store may be back soon)
        )
        self.watcher.on_store_back = reconciling.retry_now
        self.manager.register(reconciling)
        await self.manager.start_all()
        if config.reuse_port:
            # One of several processes on the port: it joins once loaded, so no connection
            # lands on an empty registry while the others could have answered it.
            assert self.server is not None
            await self.server.start(config.host, config.port, self._tls, reuse_port=True)
        log.info("frontend serving on %s", self.url)
        served = self.server.max_connections if self.server is not None else None
        if served is not None and served < config.max_connections:  # (said once serving)
            log.warning(
                "serving at most %d client connections, not %d: the limit of open files is %d "
                "(each may hold one to an instance too); raise it (ulimit -n) for more",
                served, config.max_connections, resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            )  # fmt: skip

    async def _set_up(self) -> None:
        config = self.config
        if self.discovery is None:
            self._own_store = await open_store(config.store_url)
            self.discovery = Discovery(self._own_store)
        cache = MetadataCache(
            config.cache_dir,
            timeout=config.metadata_timeout,
            max_bytes=config.metadata_cache_bytes,
            max_file_bytes=config.metadata_max_file_bytes,
        )
        self.metrics.watch_metadata_cache(cache)
        if isinstance(self.router, KvRouter):
            self.router.attach(self.registry, cache, self.metrics)
            if config.kv_events:
                self.router.tracker.use_stream(KvStreamReader(config.kv_events, config.kv_stream))
        self.watcher = ModelWatcher(
            self.discovery,
            self.registry,
            cache,
            self.metrics,
            config.namespaces,
            follow_membership=self._membership_factory is not None,
            freeze_loading=config.freeze_loading,
        )
        routes = self.routes
        self.watcher.other_changes.append(lambda: routes.version)
        store = self.watcher.store
        self.metrics.watch_store(lambda: store.unreachable_since)
        self.server = HttpServer(
            self.handle,
            max_body=config.max_body,
            keepalive_timeout=config.keepalive_timeout,
            header_timeout=config.header_timeout,
            body_timeout=config.body_timeout,
            send_timeout=config.send_timeout,
            max_header_size=config.max_header_size,
            max_headers=config.max_headers,
            max_connections=open_files.connections_within(config.max_connections),
            max_body_memory=config.max_body_memory,
            # (a request refused for its key is refused on its head: its body never read)
            head_check=self.check_head if self.keys is not None or self._keys else None,
        )
        # (Loading the system's CA bundle takes ~40 ms of CPU: off the loop, which is
        # already reading the store.)
        self.routes.tls = await asyncio.to_thread(provider_tls, config.provider_ca_file)
        self._tls = await asyncio.to_thread(server_tls, config.tls_certfile, config.tls_keyfile)
        if not config.reuse_port:
            await self.server.start(config.host, config.port, self._tls)
        if config.metrics_port is not None:
            self.metrics_server = HttpServer(self._serve_metrics, max_body=0, max_connections=64)
            await self.metrics_server.start(config.host, config.metrics_port)
        self.dashboard.start()
        self._lag = asyncio.create_task(self.metrics.sample_loop_lag(), name="loop-lag")
        # Routes and keys first: their reads are small, and behind the fleet's listings (a
        # store with one thread reading 200,000 keys for the watch stream while the loop
        # parses the first listing) they waited past the setup timeout at 100,000 instances.
        self.route_watcher = RouteWatcher(
            self.discovery.store, self.routes, secrets_interval=config.reconcile_interval
        )
        await self.route_watcher.start()
        if self.keys is not None:
            self.key_watcher = KeyWatcher(self.discovery.store, self.keys)
            await self.key_watcher.start()
            await self.limits.start()
            if self.usage is not None:
                await self.usage.start()
        self._loading = asyncio.create_task(self.watcher.start(), name="discovery:load")
        answered = asyncio.create_task(self.watcher.store_answered.wait())
        try:
            await asyncio.wait((self._loading, answered), return_when=asyncio.FIRST_COMPLETED)
        finally:
            answered.cancel()
        if self._loading.done():
            self._loading.result()  # (raises what loading raised)

    async def stop(self) -> None:
        """Drain: refuse new work, let requests in flight finish, then stop everything."""
        self.draining = True
        await self.dashboard.close()
        if self.server is not None:
            await self.server.close(self.config.drain_timeout)
        if self.metrics_server is not None:
            await self.metrics_server.close(0)
        await stop_decoder()  # (the large bodies' decoder process: no request needs it now)
        await self.manager.stop_all()
        if self._lag is not None:
            self._lag.cancel()
            await asyncio.gather(self._lag, return_exceptions=True)
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
            await asyncio.gather(self._loading, return_exceptions=True)
        if self.membership is not None:
            await self.membership.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        if isinstance(self.router, KvRouter):
            await self.router.close()
        if self.route_watcher is not None:
            await self.route_watcher.stop()
        if self.key_watcher is not None:
            await self.key_watcher.stop()
        await self.limits.stop()
        if self.usage is not None:
            await self.usage.stop()
        self.routes.close()
        self.registry.close()
        if self.proxy.deadlines is not None:
            self.proxy.deadlines.close()
        if self._own_store is not None:
            await self._own_store.close()

    def _in_force(self, view: MembershipView) -> None:
        """A new membership view: the watcher's scope follows it, and the KV indexer drops
        the instances of namespaces that left it at once (not card by card). A view whose
        scopes did not move (a taint, an endpoint joining) costs nothing here."""
        assert self.watcher is not None
        scopes = view.scopes
        if scopes is self._followed or scopes == self._followed:
            return
        self._followed = scopes
        self.watcher.follow(scopes)
        if isinstance(self.router, KvRouter):
            self.router.tracker.retain(lambda endpoint: endpoint.namespace in scopes)

    async def _follow_membership(self, membership: MembershipFollower) -> None:
        """The watcher's scope follows each view; returns once the first is in force."""
        watcher = self.watcher
        assert watcher is not None
        self.membership = membership
        membership.subscribe(self._in_force)
        await membership.start()

    async def _load_scope(self) -> None:
        """Wait until the first selection's namespaces have had their first listing applied
        (not ready before: a replica would answer 404 for models its fleet serves). Not
        bounded by `setup_timeout`, which bounds the store's answer (the membership's setup
        opened every namespace), not the fleet's size: a large fleet loads as long as it
        needs, saying how far it got every `LOAD_PROGRESS_SECONDS`."""
        assert self.watcher is not None
        while True:
            try:
                async with asyncio.timeout(LOAD_PROGRESS_SECONDS):
                    await self.watcher.scope_loaded.wait()
                break
            except TimeoutError:
                log.info("loading: %d namespaces in scope not listed yet", self.watcher.loading())
        self.scope_loaded = True

    async def __aenter__(self) -> Frontend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
