"""`Frontend`: the gateway wired together: server, routes, registry, watcher, reconciliation.

Routes: the OpenAI request routes go to the proxy; `/v1/models`, `/live`, `/health`,
`/health/controllers` and `/metrics` are small handlers on the same server.
"""

from __future__ import annotations

import hmac
import logging
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from shoal.cards import ModelType
from shoal.controllers import ControllerManager, Loop, readiness
from shoal.discovery import Discovery
from shoal.frontend import errors
from shoal.frontend.errors import ApiError
from shoal.frontend.kv_router import KvRouter
from shoal.frontend.metadata import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILE_BYTES, MetadataCache
from shoal.frontend.metrics import FrontendMetrics
from shoal.frontend.proxy import Proxy
from shoal.frontend.registry import Model, Registry
from shoal.frontend.router import make_router
from shoal.frontend.server import HttpConnection, HttpServer, Request
from shoal.frontend.watcher import ModelWatcher, Reconciler
from shoal.store import Store, open_store

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
    cache_dir: Path | None = None
    metadata_timeout: float = 30.0
    metadata_cache_bytes: int = DEFAULT_MAX_BYTES
    metadata_max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    connect_timeout: float = 5.0
    drain_timeout: float = 30.0
    keepalive_timeout: float = 75.0
    kv_overlap_weight: float = 2.0  # the kv policy: cost of an uncached block vs one of load


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
    ) -> None:
        self.config = config = config or FrontendConfig()
        self.discovery = discovery
        self._own_store: Store | None = None
        self.metrics = FrontendMetrics()
        self.registry = Registry(connect_timeout=config.connect_timeout)
        self.metrics.live_instances = self.registry.live_instances
        self.router = make_router(config.router)
        if isinstance(self.router, KvRouter):
            self.router.overlap_weight = config.kv_overlap_weight
        self.proxy = Proxy(
            self.registry,
            self.router,
            self.metrics,
            retries=config.retries,
            inhibit_seconds=config.inhibit_seconds,
            first_byte_timeout=config.first_byte_timeout,
            strip_authorization=bool(config.api_keys),
        )
        self._bearer = tuple(f"Bearer {key}".encode() for key in config.api_keys)
        self.manager = ControllerManager()
        self.watcher: ModelWatcher | None = None
        self.reconciler: Reconciler | None = None
        self.server: HttpServer | None = None
        self.draining = False
        self.started_at = time.time()
        self._models_body: tuple[int, bytes] | None = None  # (registry version, body)

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def url(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Serve at once (health says 503 until the first snapshot), then load discovery."""
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
        self.watcher = ModelWatcher(
            self.discovery, self.registry, cache, self.metrics, config.namespaces
        )
        self.server = HttpServer(
            self.handle, max_body=config.max_body, keepalive_timeout=config.keepalive_timeout
        )
        await self.server.start(config.host, config.port)
        await self.watcher.start()
        self.reconciler = Reconciler(self.watcher)
        self.manager.register(
            Loop(self.reconciler, interval=config.reconcile_interval, name=RECONCILER)
        )
        await self.manager.start_all()
        log.info("frontend serving on %s", self.url)

    async def stop(self) -> None:
        """Drain: refuse new work, let requests in flight finish, then stop everything."""
        self.draining = True
        if self.server is not None:
            await self.server.close(self.config.drain_timeout)
        await self.manager.stop_all()
        if self.watcher is not None:
            await self.watcher.stop()
        if isinstance(self.router, KvRouter):
            await self.router.close()
        self.registry.close()
        if self._own_store is not None:
            await self._own_store.close()

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
            if kind is not None:
                if request.method != b"POST":
                    raise errors.method_not_allowed(request.method.decode(), path.decode())
                self._authorize(request)
                self.proxy.handle(request, conn, kind)
                return
            if request.method != b"GET":
                known = path.startswith(b"/v1/models") or path in _CONTROL_PATHS
                if known:
                    raise errors.method_not_allowed(request.method.decode(), path.decode())
                raise errors.not_found(path.decode())
            self._control(request, conn)
        except ApiError as exc:
            conn.send_error(exc)

    def _authorize(self, request: Request) -> None:
        if not self._bearer:
            return
        given = request.header(b"authorization") or b""
        if not any(hmac.compare_digest(given, expected) for expected in self._bearer):
            raise errors.unauthorized()

    def _control(self, request: Request, conn: HttpConnection) -> None:
        path = request.path
        if path == b"/v1/models":
            self._authorize(request)
            conn.send(200, self._models_list())
        elif path.startswith(b"/v1/models/"):
            self._authorize(request)
            name = urllib.parse.unquote(path[len(b"/v1/models/") :].decode())
            model = self.registry.models.get(name)
            if model is None or not model.serving:
                raise errors.model_not_found(name)
            conn.send(200, _json(self._model_object(model)))
        elif path == b"/live":
            if self.draining:
                conn.send(503, _json({"status": "shutting down"}))
            else:
                conn.send(200, _json({"status": "ok"}))
        elif path == b"/health":
            status, body = self.health()
            conn.send(status, _json(body))
        elif path == b"/health/controllers":
            status, body = readiness(self.manager)
            conn.send(status, _json(body))
        elif path == b"/metrics":
            conn.send(200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
        else:
            raise errors.not_found(path.decode())

    def _models_list(self) -> bytes:
        """The `/v1/models` body, encoded again only after the registry changed."""
        cached = self._models_body
        if cached is None or cached[0] != self.registry.version:
            data = [self._model_object(m) for m in self.registry.serving()]
            cached = self._models_body = (
                self.registry.version,
                _json({"object": "list", "data": data}),
            )
        return cached[1]

    def health(self) -> tuple[int, dict[str, Any]]:
        """503 while starting or draining; else 200 with what the registry knows."""
        if self.draining:
            return 503, {"status": "draining"}
        if self.watcher is None or not self.watcher.snapshot_loaded.is_set():
            return 503, {"status": "starting"}
        models = {
            name: {
                "serving": model.serving,
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
            "models": models,
            "instances": instances,
            "incomplete": incomplete,
            "metadata_cache": self.watcher.cache.status(),
        }

    def _model_object(self, model: Model) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": model.name,
            "object": "model",
            "created": model.created,
            "owned_by": "shoal",
        }
        if model.parent is not None:
            obj["parent"] = model.parent
        return obj


_CONTROL_PATHS = frozenset({b"/live", b"/health", b"/health/controllers", b"/metrics"})
