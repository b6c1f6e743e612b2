"""The status server: one per worker process, beside the request port.

- `GET /live`: 200 while running and not shutting down.
- `GET /health`: 200 with the served endpoints and models when every endpoint serves and
  the lease is held; 503 with the reasons otherwise.
- `GET /metrics`: Prometheus text from the runtime's own registry.
- `GET /v1/metadata/{namespace}/{component}/{endpoint}/{slug}/{suffix}/{filename}`: a
  model's metadata file, as its card lists it (suffix `_` for the base model).
- `GET|POST /v1/loras`, `DELETE /v1/loras/{name}`: list, load and unload LoRA adapters
  at run time (Bearer `admin_token` required for changes when one is set).
"""

from __future__ import annotations

import hmac
import logging
import mimetypes
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shoal.discovery import EndpointId, ModelConflictError
from shoal.store import StoreError
from shoal.worker.endpoint import (
    SHUTDOWN_GRACE,
    Attached,
    Endpoint,
    adapter_suffix,
    advertised_host,
)
from shoal.worker.engine import EngineUnavailableError
from shoal.worker.metadata import CollisionError, MetadataKey
from shoal.worker.protocol import OpenAIError, decode_request, openai_errors

if TYPE_CHECKING:
    from shoal.worker.runtime import Runtime

log = logging.getLogger(__name__)

_BAD_SEGMENT_CHARS = ("/", "\\", "\x00")


class LoadLora(msgspec.Struct):
    name: str
    path: str
    endpoint: str | None = None


_load_lora_decoder = msgspec.json.Decoder(LoadLora)


class StatusServer:
    """Serves the status routes of one `Runtime`."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._paths: dict[tuple[EndpointId, str], str] = {}  # adapter -> path loaded from

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors])
        app.router.add_get("/live", self.live)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get(
            "/v1/metadata/{namespace}/{component}/{endpoint}/{slug}/{suffix}/{filename}",
            self.metadata,
        )
        app.router.add_get("/v1/loras", self.list_loras)
        app.router.add_post("/v1/loras", self.load_lora)
        app.router.add_delete("/v1/loras/{name:.+}", self.unload_lora)
        return app

    async def start(self, host: str, port: int) -> None:
        runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        self.url = f"http://{advertised_host(host)}:{runner.addresses[0][1]}"

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # -- probes -------------------------------------------------------------------------

    async def live(self, request: web.Request) -> web.Response:
        if self.runtime.draining:
            return web.json_response({"status": "shutting down"}, status=503)
        return web.json_response({"status": "ok"})

    async def health(self, request: web.Request) -> web.Response:
        healthy, body = await self.runtime.health()
        return web.json_response(body, status=200 if healthy else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.runtime.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    # -- metadata -----------------------------------------------------------------------

    async def metadata(self, request: web.Request) -> web.StreamResponse:
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
            if part in ("", ".", "..") or any(c in part for c in _BAD_SEGMENT_CHARS):
                raise OpenAIError(400, f"invalid metadata path segment {part!r}")
        data = self.runtime.metadata.lookup(key)
        if data is None:
            raise OpenAIError(404, f"no metadata file at {key.path}", code="not_found")
        content_type = mimetypes.guess_type(key.filename)[0] or "application/octet-stream"
        return web.Response(body=data, content_type=content_type)

    # -- adapters -----------------------------------------------------------------------

    def _authorize(self, request: web.Request) -> None:
        token = self.runtime.admin_token
        if not token:
            return
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        try:  # aiohttp keeps undecodable header bytes as lone surrogates
            given_bytes = given.encode()
        except UnicodeEncodeError:
            given_bytes = b""
        if scheme.lower() != "bearer" or not hmac.compare_digest(given_bytes, token.encode()):
            raise OpenAIError(
                401,
                "A valid admin token is required: send `Authorization: Bearer <token>`.",
                code="invalid_api_key",
            )

    def _endpoint(self, name: str | None) -> Endpoint:
        serving = [ep for ep in self.runtime.endpoints.values() if ep.serving]
        if name is not None:
            for ep in serving:
                if str(ep.id) == name:
                    return ep
            raise OpenAIError(404, f"no endpoint {name!r} is served here", param="endpoint")
        if len(serving) != 1:
            raise OpenAIError(
                400, "this worker serves several endpoints: name one", param="endpoint"
            )
        return serving[0]

    async def list_loras(self, request: web.Request) -> web.Response:
        loras = [
            _lora_body(ep, att.card.display_name, suffix, path=self._paths.get((ep.id, suffix)))
            for ep in self.runtime.endpoints.values()
            for suffix, att in ep.models.items()
            if suffix is not None and att.card.lora is not None
        ]
        return web.json_response({"object": "list", "data": loras})

    async def load_lora(self, request: web.Request) -> web.Response:
        """Load adapter `name` from `path` and announce it; a refused load changes nothing.

        Loads of one name are serialised per endpoint: the first wins; a later load with the
        same path answers 200 without touching the engine (idempotent), one with another
        path 409. The conflict is decided before the engine is asked, so the live adapter
        keeps serving.
        """
        self._authorize(request)
        body = decode_request(await request.read(), _load_lora_decoder)
        if not body.name:
            raise OpenAIError(400, "name must not be empty", param="name")
        if self.runtime.draining:
            raise OpenAIError(503, "the worker is draining")
        ep = self._endpoint(body.endpoint)
        assert ep.engine is not None
        try:
            suffix = adapter_suffix(body.name)
        except ValueError as exc:
            raise OpenAIError(400, f"invalid adapter name: {exc}", param="name") from None
        async with ep.sync_lock:
            held = ep.models.get(suffix)
            if held is not None:
                return self._reloaded(ep, held, body, suffix)
            try:
                served = await ep.engine.load_adapter(body.name, body.path)
            except EngineUnavailableError as exc:
                raise OpenAIError(501, str(exc)) from None
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="name") from None
            try:
                await ep.attach_served(served)
            except (StoreError, OSError, ModelConflictError, CollisionError, ValueError) as exc:
                await _unload_quietly(ep, body.name)
                status = 503 if isinstance(exc, StoreError | OSError) else 409
                raise OpenAIError(status, f"could not announce adapter: {exc}") from None
            self._paths[(ep.id, suffix)] = body.path
        return web.json_response(_lora_body(ep, body.name, suffix, path=body.path))

    def _reloaded(self, ep: Endpoint, held: Attached, body: LoadLora, suffix: str) -> web.Response:
        """A load of a suffix already attached: 200 if it is the same load, else 409."""
        path = self._paths.get((ep.id, suffix))
        if held.card.display_name != body.name:
            raise OpenAIError(
                409,
                f"adapter {body.name!r} would take suffix {suffix!r}, held by "
                f"{held.card.display_name!r}",
                param="name",
            )
        if path != body.path:
            loaded = "by its engine" if path is None else f"from {path!r}"
            raise OpenAIError(
                409,
                f"adapter {body.name!r} is already loaded {loaded}: unload it before "
                f"loading it from {body.path!r}",
                param="name",
            )
        return web.json_response(_lora_body(ep, body.name, suffix, path=path))

    async def unload_lora(self, request: web.Request) -> web.Response:
        self._authorize(request)
        name = request.match_info["name"]
        try:
            suffix = adapter_suffix(name)
        except ValueError:
            raise OpenAIError(404, f"no adapter {name!r} is loaded", param="name") from None
        for ep in self.runtime.endpoints.values():
            att = ep.models.get(suffix)
            if att is None or att.card.lora is None or att.card.display_name != name:
                continue
            async with ep.sync_lock:
                await ep.detach_model(suffix)  # discovery first, then metadata
                await _unload_quietly(ep, name)
                self._paths.pop((ep.id, suffix), None)
            return web.json_response({"object": "lora", "name": name, "deleted": True})
        raise OpenAIError(404, f"no adapter {name!r} is loaded", param="name", code="not_found")


async def _unload_quietly(ep: Endpoint, name: str) -> None:
    if ep.engine is None:
        return
    try:
        await ep.engine.unload_adapter(name)
    except Exception as exc:
        log.warning("engine %s: unloading adapter %r failed: %s", ep.engine.name, name, exc)


def _lora_body(
    ep: Endpoint, name: str, suffix: str | None, path: str | None = None
) -> dict[str, Any]:
    att = ep.models.get(suffix)
    body: dict[str, Any] = {
        "object": "lora",
        "name": name,
        "suffix": suffix,
        "endpoint": str(ep.id),
        "base_model": att.card.lora.base_model if att and att.card.lora else None,
        "mdcsum": att.card.mdcsum if att else None,
    }
    if path is not None:
        body["path"] = path
    return body
