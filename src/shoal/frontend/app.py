"""`Frontend`: the gateway wired together: server, routes, registry, watcher, reconciliation.

Routes: the OpenAI request routes go to the proxy; `/v1/models`, `/live`, `/ready`,
`/health`, `/health/controllers` and `/metrics` are small handlers on the same server.
`/live` is the liveness probe (503 only while shutting down), `/ready` the readiness probe
(503 with reasons while starting, draining, or a control loop is stuck on its own work; never
for the store or a worker, which every replica shares), and `/health` a report for people
(200 once started, whatever the store's state). `/health/controllers` reports every loop in
trouble and the store's outage.
`/v1/membership` and `/v1/membership/status` are served when the scope follows a membership
watch.

Virtual models (the routes of `workspaces`, see `virtual`) are served beside discovered
models: `Frontend.routes` is the table, `routes.describe()` its report (also in `/health`).

Exposure: with API keys, `/health` shows its details only to a caller with a key (or to
anyone with `public_health`); with `metrics_port`, `/metrics` is served there alone (plain
HTTP, for a scraper), not on the API's port.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec

from shoal.cards import ModelType
from shoal.controllers import ControllerManager, Loop, LoopCollector, readiness
from shoal.discovery import Discovery, Query
from shoal.discovery.grants import Grant
from shoal.frontend.dashboard.dashboard import Dashboard
from shoal.frontend.http import errors
from shoal.frontend.http.cors import Cors
from shoal.frontend.http.listener import HttpServer
from shoal.frontend.http.request import Request, bearer_token
from shoal.frontend.http.server import HttpConnection
from shoal.frontend.keys.gate import Gate
from shoal.frontend.keys.keys import KeyRing, KeyWatcher, models_for
from shoal.frontend.keys.limits import Limits
from shoal.frontend.keys.usage import UsageBook
from shoal.frontend.kv.router import KvRouter
from shoal.frontend.kv.stream import KvStreamReader
from shoal.frontend.proxy.disagg import TwoStages
from shoal.frontend.proxy.fields import decode_fields
from shoal.frontend.proxy.proxy import Proxy
from shoal.frontend.registry.metadata import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_FILE_BYTES,
    MetadataCache,
)
from shoal.frontend.registry.metrics import FrontendMetrics
from shoal.frontend.registry.registry import Model, Registry
from shoal.frontend.registry.router import make_router
from shoal.frontend.registry.watcher import ModelWatcher, Reconciler
from shoal.frontend.virtual.routes import RouteWatcher
from shoal.frontend.virtual.secrets import Secrets
from shoal.frontend.virtual.virtual import FleetChoice, RouteTable, VirtualModel
from shoal.openai import ApiError
from shoal.store import Store, StoreUnavailableError, default_store_url, open_store

log = logging.getLogger(__name__)

PROXY_ROUTES = {
    b"/v1/chat/completions": ModelType.CHAT,
    b"/v1/completions": ModelType.COMPLETIONS,
    b"/v1/embeddings": ModelType.EMBEDDINGS,
}
RECONCILER = "model-reconciler"
_json = msgspec.json.encode


@dataclass
class FrontendConfig:
    """Every setting of a frontend; the CLI fills it from flags and `SHOAL_*` variables."""

    store_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    namespaces: tuple[str, ...] = ()
    router: str = "round-robin"
    reconcile_interval: float = 30.0
    api_keys: tuple[str, ...] = ()
    max_body: int = 16 * 1024 * 1024
    retries: int = 2
    inhibit_seconds: float = 5.0
    first_byte_timeout: float = 60.0  # seconds for a worker to start answering; 0: no limit
    upstream_idle_timeout: float = 60.0  # seconds a worker may pause mid-response; 0: no limit
    migration_limit: int = 1  # times a stream may move to another instance mid-stream; 0: never
    cache_dir: Path | None = None
    metadata_timeout: float = 30.0
    metadata_cache_bytes: int = DEFAULT_MAX_BYTES
    metadata_max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    connect_timeout: float = 5.0
    drain_timeout: float = 30.0
    keepalive_timeout: float = 75.0
    header_timeout: float = 10.0  # seconds to receive a request head; 0: no limit
    body_timeout: float = 30.0  # seconds between request body bytes; 0: no limit
    max_connections: int = 10_000
    max_header_size: int = 64 * 1024  # bytes of request line and headers
    max_headers: int = 100
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any)
    public_health: bool = False  # with API keys, `/health` details without the key too
    metrics_port: int | None = None  # serve `/metrics` on this port (same host) instead
    setup_timeout: float = 10.0  # seconds for the store to answer the first listing
    # The scope follows a membership watch (built by `shoal.cli`) instead of `namespaces`:
    namespace_sources: Path | None = None
    namespaces_from_discovery: bool = False
    endpoint_prefixes: tuple[str, ...] = ()
    kv_overlap_weight: float = 2.0  # the kv policy: cost of an uncached block vs one of load
    kv_events: str | None = None  # the kv policy: nats://... reads the relay's stream, not ZMQ
    kv_stream: str = "shoal-kv"
    # Virtual models: the workspaces whose routes are served (the first wins a name clash),
    # where providers' secrets are files, and a CA file to trust beside the system's.
    workspaces: tuple[str, ...] = ("default",)
    secrets_dir: Path | None = None
    provider_ca_file: Path | None = None
    # Serve HTTPS instead of HTTP (both files, PEM).
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = None
    # One of several processes listening on `port` (`SO_REUSEPORT`; `shoal.cli.processes`).
    reuse_port: bool = False
    # `keys`: requests need a catalog API key (or an `api_keys` one), checked against the
    # grants of `workspaces` in the store, hashed with `key_pepper` (see `keys`).
    auth: str = "api-key"
    key_pepper: str = ""
    limits_url: str | None = None  # redis://HOST:6379: rpm and tpm shared by the frontends
    catalog_url: str | None = None  # where the keys' usage is flushed (`POST /v1/usage`)
    catalog_token: str | None = None
    usage_interval: float = 10.0  # seconds between two flushes of usage


class MembershipView(Protocol):
    """The namespaces in force and their queries (`shoal.membership.Membership`)."""

    @property
    def scopes(self) -> Mapping[str, tuple[Query, ...]]: ...

    def to_dict(self) -> dict[str, Any]: ...


class MembershipStatusView(Protocol):
    @property
    def applied_revision(self) -> str | None: ...

    @property
    def last_error(self) -> str | None: ...

    def to_dict(self) -> dict[str, Any]: ...


class MembershipFollower(Protocol):
    """What the frontend needs of a membership watch (`shoal.membership.MembershipWatch`).

    Layer-5 packages do not import each other: `shoal.cli` builds the watch and hands the
    frontend a factory of it; the frontend only subscribes to its views.
    """

    @property
    def view(self) -> MembershipView: ...

    @property
    def status(self) -> MembershipStatusView: ...

    def subscribe(self, callback: Callable[[MembershipView], None]) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Frontend:
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
        self.reconciler: Reconciler | None = None
        self.server: HttpServer | None = None
        self.metrics_server: HttpServer | None = None  # `/metrics` alone, on `metrics_port`
        self._tls: ssl.SSLContext | None = None
        # One process of several: `/metrics` on the API port answers the whole frontend's.
        self.metrics_source: Callable[[], Awaitable[bytes]] | None = None
        self.draining = False
        self.started_at = time.time()
        # ((registry version, route table version), body)
        self._models_body: tuple[tuple[int, int], bytes] | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def url(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        scheme = "https" if self.config.tls_certfile is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> None:
        """Serve at once (health says 503 until the first snapshot), then load discovery,
        then put the first membership selection in force (when the scope follows one).

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
        self.reconciler = Reconciler(self.watcher)
        self.manager.register(
            Loop(self.reconciler, interval=config.reconcile_interval, name=RECONCILER)
        )
        await self.manager.start_all()
        if config.reuse_port:
            # One of several processes on the port: it joins once loaded, so no connection
            # lands on an empty registry while the others could have answered it.
            assert self.server is not None
            await self.server.start(config.host, config.port, self._tls, reuse_port=True)
        log.info("frontend serving on %s", self.url)

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
        )
        store = self.watcher.store
        self.metrics.watch_store(lambda: store.unreachable_since)
        self.server = HttpServer(
            self.handle,
            max_body=config.max_body,
            keepalive_timeout=config.keepalive_timeout,
            header_timeout=config.header_timeout,
            body_timeout=config.body_timeout,
            max_header_size=config.max_header_size,
            max_headers=config.max_headers,
            max_connections=config.max_connections,
        )
        self.routes.tls = provider_tls(config.provider_ca_file)
        self._tls = server_tls(config.tls_certfile, config.tls_keyfile)
        if not config.reuse_port:
            await self.server.start(config.host, config.port, self._tls)
        if config.metrics_port is not None:
            self.metrics_server = HttpServer(self._serve_metrics, max_body=0, max_connections=64)
            await self.metrics_server.start(config.host, config.metrics_port)
        self.dashboard.start()
        self._loading = asyncio.create_task(self.watcher.start(), name="discovery:load")
        answered = asyncio.create_task(self.watcher.store_answered.wait())
        try:
            await asyncio.wait((self._loading, answered), return_when=asyncio.FIRST_COMPLETED)
        finally:
            answered.cancel()
        if self._loading.done():
            self._loading.result()  # (raises what loading raised)
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

    async def stop(self) -> None:
        """Drain: refuse new work, let requests in flight finish, then stop everything."""
        self.draining = True
        await self.dashboard.close()
        if self.server is not None:
            await self.server.close(self.config.drain_timeout)
        if self.metrics_server is not None:
            await self.metrics_server.close(0)
        await self.manager.stop_all()
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

    async def __aenter__(self) -> Frontend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- routes ------------------------------------------------------------------------------

    def handle(self, request: Request, conn: HttpConnection) -> None:
        path = request.path
        kind = PROXY_ROUTES.get(path)
        try:
            if self.cors is not None and self._cross_origin(request, conn):
                return
            if kind is not None:
                if request.method != b"POST":
                    raise errors.method_not_allowed(
                        request.method.decode(), path.decode(), (b"POST",)
                    )
                grant = self._authorize(request)
                if grant is not None:
                    model = decode_fields(request.body).model or ""
                    KeyRing.admit(grant, model)  # 403 before the model is looked up
                    self.gate.handle(request, conn, kind, grant, model)
                    return
                self.proxy.handle(request, conn, kind)
                return
            if path == b"/ui" or path.startswith(b"/ui/"):  # the fleet page (dashboard.py)
                self.dashboard.handle(request, conn)
                return
            if request.method != b"GET" and request.method != b"HEAD":  # HEAD: a GET, no body
                known = path.startswith(b"/v1/models") or path in _CONTROL_PATHS
                if known:
                    raise errors.method_not_allowed(
                        request.method.decode(), path.decode(), (b"GET", b"HEAD")
                    )
                raise errors.not_found(path.decode())
            self._control(request, conn)
        except ApiError as exc:
            conn.send(exc.status, exc.body(), headers=exc.headers)

    def _cross_origin(self, request: Request, conn: HttpConnection) -> bool:
        """Add CORS headers for an allowed origin; True once a preflight is answered."""
        assert self.cors is not None
        origin = request.header(b"origin")
        if origin is None:
            return False
        allowed = self.cors.allows(origin)
        if request.method == b"OPTIONS" and request.header(b"access-control-request-method"):
            if not allowed:
                raise errors.origin_not_allowed(origin.decode("latin-1"))
            requested = request.header(b"access-control-request-headers")
            conn.extra_headers = self.cors.preflight_headers(origin, requested)
            conn.send(204, b"")
            return True
        if allowed:
            conn.extra_headers = self.cors.response_headers(origin)
        return False

    def _authorize(self, request: Request) -> Grant | None:
        """The key's grant with `--auth keys` (None for an `--api-key`); 401 if refused."""
        if self.keys is not None:
            return self.keys.check(request.header(b"authorization"))
        if not self._authorized(request):
            raise errors.unauthorized()
        return None

    def _authorized(self, request: Request) -> bool:
        """An operator's request: no key is configured, or it bears an `--api-key` (`Bearer`,
        in any case). With `--auth keys` a team's key is not an operator's: without an
        `--api-key` nobody is (details of `/health` then need `--public-health`)."""
        if not self._keys:
            return self.keys is None
        token = bearer_token(request.header(b"authorization"))
        return token is not None and any(hmac.compare_digest(token, k) for k in self._keys)

    def _control(self, request: Request, conn: HttpConnection) -> None:
        path = request.path
        if path == b"/v1/models":
            grant = self._authorize(request)
            conn.send(200, models_for(self._models_list(), grant))
        elif path.startswith(b"/v1/models/"):
            grant = self._authorize(request)
            name = urllib.parse.unquote(path[len(b"/v1/models/") :].decode())
            if not KeyRing.allows(grant, name):  # as if absent: nothing told about it
                raise errors.model_not_found(name)
            virtual = self.routes.models.get(name)
            if virtual is not None:  # wins over a discovered model of the same name
                if not virtual.serving:
                    raise errors.model_not_found(name)
                conn.send(200, _json(self._virtual_object(virtual)))
                return
            model = self.registry.models.get(name)
            if model is None or not model.listed:
                raise errors.model_not_found(name)
            if not model.serving:
                raise errors.no_ready_instance(name)  # draining: the same 503 as requests
            conn.send(200, _json(self._model_object(model)))
        elif path == b"/live":
            if self.draining:
                conn.send(503, _json({"status": "shutting down"}))
            else:
                conn.send(200, _json({"status": "ok"}))
        elif path == b"/ready":
            status, body = self.readiness()
            conn.send(status, _json(body))
        elif path == b"/health":
            status, body = self.health()
            if not self.config.public_health and not self._authorized(request):
                body = {k: v for k, v in body.items() if k in _PUBLIC_HEALTH}
            conn.send(status, _json(body))
        elif path == b"/health/controllers":
            status, body = readiness(self.manager)
            if self.membership is not None and self.membership.status.last_error:
                status, body["status"] = 503, "unavailable"
                body["unhealthy"]["membership"] = self.membership.status.last_error
            if self.watcher is not None and (outage := self.watcher.store.outage()) is not None:
                status, body["status"] = 503, "unavailable"
                body["unhealthy"]["store"] = outage
            if not self.config.public_health and not self._authorized(request):
                # The reasons quote errors (the store's address, a user name): names only.
                body["unhealthy"] = dict.fromkeys(body["unhealthy"], "unhealthy")
            conn.send(status, _json(body))
        elif path in (b"/v1/membership", b"/v1/membership/status"):
            self._authorize(request)
            if self.membership is None:
                raise errors.not_found(path.decode())
            if path == b"/v1/membership":
                conn.send(200, _json(self.membership.view.to_dict()))
            else:
                conn.send(200, _json(self.membership.status.to_dict()))
        elif path == b"/metrics" and self.metrics_server is None:
            if self.metrics_source is None:
                conn.send(200, self.metrics.render(), _METRICS_TYPE)
            else:
                _MetricsLater(conn, self.metrics_source())
        else:
            raise errors.not_found(path.decode())

    def _serve_metrics(self, request: Request, conn: HttpConnection) -> None:
        """The `metrics_port` server's one route."""
        if request.path != b"/metrics":
            error = errors.not_found(request.path.decode())
        elif request.method not in (b"GET", b"HEAD"):
            error = errors.method_not_allowed(
                request.method.decode(), "/metrics", (b"GET", b"HEAD")
            )
        else:
            conn.send(200, self.metrics.render(), _METRICS_TYPE)
            return
        conn.send(error.status, error.body(), headers=error.headers)

    def _models_list(self) -> bytes:
        """The `/v1/models` body, encoded again only after the registry or the routes changed:
        discovered models and the virtual models with a serving target, by name (a virtual
        model hides a discovered one of its name)."""
        cached = self._models_body
        version = (self.registry.version, self.routes.version)
        if cached is None or cached[0] != version:
            routes = self.routes
            data = [
                self._model_object(m) for m in self.registry.listed() if not routes.shadows(m.name)
            ]
            data += [self._virtual_object(v) for v in routes.models.values() if v.serving]
            data.sort(key=lambda obj: str(obj["id"]))
            cached = self._models_body = (version, _json({"object": "list", "data": data}))
        return cached[1]

    def _live_instances(self) -> dict[str, int]:
        """Instances by model name, discovered and virtual (a virtual model wins a name)."""
        live = self.registry.live_instances()
        if self.routes.models:
            live.update(self.routes.live_instances())
        return live

    def readiness(self) -> tuple[int, dict[str, Any]]:
        """200 when this frontend should get traffic; else 503 with every reason, by source.

        Only what taking this replica out can help: starting, draining, a loop stuck on its
        own work. Never a store outage or one bad worker: every replica shares those, and
        failing all of them at once would turn a degraded fleet into no fleet (each still
        serves from what it knows). Those show in `/health`, `/health/controllers`, metrics."""
        reasons: dict[str, str] = {}
        if self.draining:
            reasons["frontend"] = "draining"
        elif self.watcher is None or not self.watcher.snapshot_loaded.is_set():
            reasons["frontend"] = "starting: the first discovery snapshot is not loaded yet"
        elif self._membership_factory is not None and (
            self.membership is None or self.membership.status.applied_revision is None
        ):
            reasons["membership"] = "starting: no namespace selection is in force yet"
        reasons.update(self.manager.stuck())
        if reasons:
            return 503, {"status": "not ready", "reasons": reasons}
        return 200, {"status": "ready"}

    def health(self) -> tuple[int, dict[str, Any]]:
        """503 while starting or draining; else 200 with what the registry knows."""
        if self.draining:
            return 503, {"status": "draining"}
        if self.watcher is None:
            return 503, {"status": "starting"}
        if not self.watcher.snapshot_loaded.is_set():
            return 503, {"status": "starting", "loading": self.watcher.progress()}
        models = {
            name: {
                "serving": model.serving,
                "disaggregated": model.stages is not None,
                "incomplete": model.incomplete,
                "instances": model.live_instances,
                "worker_sets": [
                    {
                        "namespace": ws.id.namespace,
                        "component": ws.id.component,
                        "role": str(ws.id.role),
                        "mdcsum": ws.mdcsum,
                        "instances": sorted(f"{u.instance_id:x}" for u in ws.routable),
                        "members": len(ws.members),
                    }
                    for ws in model.sets.values()
                ],
            }
            for name, model in sorted(self.registry.models.items())
        }
        incomplete = [
            {"key": str(r.model.key), "state": r.state.value, "error": r.error}
            for r in self.watcher.incomplete()
        ]
        instances = len(
            {u.instance_id for m in self.registry.models.values() for ws in m.sets.values() for u in ws.routable}
        )  # fmt: skip
        return 200, {
            "status": "ok",
            "store": self.watcher.store.report(),
            "models": models,
            "instances": instances,
            "incomplete": incomplete,
            "metadata_cache": self.watcher.cache.status(),
            "routing": self.router.describe(),
            "skipped": [
                {"key": key, "reason": reason}
                for key, reason in sorted(self.watcher.discovery.skipped.items())
            ],
            "virtual_models": self.routes.describe(),
            **(
                {
                    "keys": self.keys.describe(),
                    "limits": self.limits.describe(),
                    "usage": self.usage.describe() if self.usage is not None else None,
                }
                if self.keys is not None
                else {}
            ),
        }

    def _model_object(self, model: Model) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": model.name,
            "object": "model",
            "created": model.created,
            "owned_by": "shoal",
        }
        parent = None if model.parent is None else self.registry.models.get(model.parent)
        if parent is not None and parent.listed:  # never name a model that is not listed
            obj["parent"] = parent.name
        return obj

    def _virtual_object(self, virtual: VirtualModel) -> dict[str, Any]:
        """A virtual model as `/v1/models` shows it; `created` is its first fleet target's."""
        created = 0
        for choice in virtual.choices:
            fleet = isinstance(choice, FleetChoice)
            model = self.registry.models.get(choice.served) if fleet else None
            if model is not None:
                created = model.created
                break
        return {"id": virtual.name, "object": "model", "created": created, "owned_by": "shoal"}


class _MetricsLater:
    """A `/metrics` answer produced by an awaitable (the merged metrics of several
    processes); cancelled if the client goes away, 503 if the awaitable fails."""

    def __init__(self, conn: HttpConnection, body: Awaitable[bytes]) -> None:
        self.task = asyncio.ensure_future(self._answer(conn, body))
        conn.produce_later(self)

    @staticmethod
    async def _answer(conn: HttpConnection, body: Awaitable[bytes]) -> None:
        try:
            data = await body
        except Exception as exc:
            error = errors.unavailable(f"the frontend's metrics could not be gathered: {exc}")
            conn.send(error.status, error.body(), headers=error.headers)
        else:
            conn.send(200, data, _METRICS_TYPE)

    def cancel(self) -> None:
        self.task.cancel()


def provider_tls(ca_file: Path | None) -> ssl.SSLContext:
    """The client context for HTTPS providers: the system's CAs (and `ca_file`'s), SNI and
    certificate verification on, HTTP/1.1."""
    context = ssl.create_default_context()
    if ca_file is not None:
        context.load_verify_locations(cafile=str(ca_file))
    context.set_alpn_protocols(["http/1.1"])
    return context


def server_tls(certfile: Path | None, keyfile: Path | None) -> ssl.SSLContext | None:
    """The server context for `--tls-certfile`/`--tls-keyfile`, or None to serve plain HTTP."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise ValueError("--tls-certfile and --tls-keyfile go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(certfile), str(keyfile))
    except OSError as exc:  # ssl.SSLError too: the files exist but do not hold a key pair
        reason = exc.strerror or str(exc)
        raise ValueError(
            f"cannot load the certificate {certfile} and key {keyfile}: {reason}"
        ) from None
    context.set_alpn_protocols(["http/1.1"])
    return context


_METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_PUBLIC_HEALTH = frozenset({"status", "reasons"})
"""What `/health` tells a caller without the API key (unless `--public-health`)."""

_CONTROL_PATHS = frozenset(
    {b"/live", b"/ready", b"/health", b"/health/controllers", b"/metrics"}
    | {b"/v1/membership", b"/v1/membership/status"}
)
