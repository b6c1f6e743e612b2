"""The status server: one per worker process, beside the request port.

- `GET /live`: 200 while running and not shutting down.
- `GET /health`: 200 with the served endpoints and models when every endpoint serves and
  the lease is held; 503 with the reasons otherwise (`Health`).
- `GET /metrics`: Prometheus text from the process's own metrics registry.
- `GET /v1/metadata/{namespace}/{component}/{endpoint}/{slug}/{suffix}/{filename}`: a
  model's metadata file, as its card lists it (suffix `_` for the base model).
- `GET|POST /v1/loras`, `DELETE /v1/loras/{name}`: list, load and unload LoRA adapters
  at run time (`AdapterRoutes`; Bearer `admin_token` required for changes when one is set).

It holds `STATUS_MAX_CONNECTIONS` connections at once, heads, bodies, unread answers
(`STATUS_SEND_TIMEOUT`) and idle keep-alive timed (`http_server`).
"""

from __future__ import annotations

import mimetypes

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from shoal.openai import ApiError
from shoal.worker.adapters import AdapterRoutes
from shoal.worker.endpoint import SHUTDOWN_GRACE, advertised_host
from shoal.worker.health import Health
from shoal.worker.http_server import STATUS_MAX_CONNECTIONS, STATUS_SEND_TIMEOUT, start_server
from shoal.worker.metadata import MetadataKey, MetadataRegistry, url_segment
from shoal.worker.protocol import openai_errors


class StatusServer:
    """Serves a process's health, its metrics, its models' metadata files and the adapter
    routes; it holds those four and nothing else of the process."""

    def __init__(
        self,
        health: Health,
        metrics_registry: CollectorRegistry,
        metadata: MetadataRegistry,
        adapters: AdapterRoutes,
    ) -> None:
        self.health = health
        self.metrics_registry = metrics_registry
        self.metadata = metadata
        self.adapters = adapters
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors])
        app.router.add_get("/live", self.get_live)
        app.router.add_get("/health", self.get_health)
        app.router.add_get("/metrics", self.get_metrics)
        app.router.add_get(
            "/v1/metadata/{namespace}/{component}/{endpoint}/{slug}/{suffix}/{filename}",
            self.get_metadata,
        )
        app.router.add_get("/v1/loras", self.adapters.list_loras)
        app.router.add_post("/v1/loras", self.adapters.load_lora)
        app.router.add_delete("/v1/loras/{name:.+}", self.adapters.unload_lora)
        return app

    async def start(self, host: str, port: int) -> None:
        runner = await start_server(
            self.app(),
            host,
            port,
            max_connections=STATUS_MAX_CONNECTIONS,
            send_timeout=STATUS_SEND_TIMEOUT,
            access_log=None,
            shutdown_timeout=SHUTDOWN_GRACE,
        )
        self._runner = runner
        self.url = f"http://{advertised_host(host)}:{runner.addresses[0][1]}"

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # -- probes -------------------------------------------------------------------------

    async def get_live(self, request: web.Request) -> web.Response:
        if not self.health.live:
            return web.json_response({"status": "shutting down"}, status=503)
        return web.json_response({"status": "ok"})

    async def get_health(self, request: web.Request) -> web.Response:
        healthy, body = await self.health.check()
        return web.json_response(body, status=200 if healthy else 503)

    async def get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics_registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    # -- metadata -----------------------------------------------------------------------

    async def get_metadata(self, request: web.Request) -> web.StreamResponse:
        """An exact lookup of the six decoded segments; never a path built from the URL."""
        info = request.match_info
        key = MetadataKey(
            info["namespace"],
            info["component"],
            info["endpoint"],
            info["slug"],
            info["suffix"],
            info["filename"],
        )
        for part in key:
            if not url_segment(part):
                raise ApiError(400, f"invalid metadata path segment {part!r}")
        data = self.metadata.lookup(key)
        if data is None:
            raise ApiError(404, f"no metadata file at {key.path}", code="not_found")
        content_type = mimetypes.guess_type(key.filename)[0] or "application/octet-stream"
        return web.Response(body=data, content_type=content_type)
