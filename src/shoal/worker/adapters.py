"""`AdapterRoutes`: the status server's LoRA admin routes, loading adapters at run time.

- `GET /v1/loras`: the adapters attached, on every endpoint.
- `POST /v1/loras {"name", "path"[, "endpoint"]}`: load an adapter into an endpoint's
  engine and announce it.
- `DELETE /v1/loras/{name}`: withdraw the adapter (discovery first, then metadata), then
  unload it; an engine that cannot unload adapters answers 501 and nothing is withdrawn,
  an unload that fails answers 409 and the adapter is announced again as it was.

Changes need `Authorization: Bearer <admin_token>` when a token is set.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Mapping
from typing import Any

import msgspec
from aiohttp import web

from shoal.discovery import EndpointId, ModelConflictError
from shoal.openai import ApiError, decode_request
from shoal.store import StoreError
from shoal.urls import redact_url
from shoal.worker.endpoint import Endpoint, adapter_suffix
from shoal.worker.engine import EngineUnavailableError
from shoal.worker.metadata import CollisionError
from shoal.worker.registrations import Attached

log = logging.getLogger(__name__)


LISTED_PER_TURN = 512
"""Adapters `GET /v1/loras` describes (its card's mdcsum computed) and encodes in one turn of
the event loop: all 20,000 of a worker in one turn held its loop 233 ms per call."""


class LoadLora(msgspec.Struct):
    name: str
    path: str
    endpoint: str | None = None


_load_lora_decoder = msgspec.json.Decoder(LoadLora)
_encoder = msgspec.json.Encoder()


class AdapterRoutes:
    """Loads, lists and unloads the LoRA adapters of a process's endpoints.

    An adapter loaded here is remembered with the path it came from, so a repeated load is
    told apart from a conflicting one; loads are refused once the drain has begun.
    """

    def __init__(
        self,
        endpoints: Mapping[EndpointId, Endpoint],
        *,
        admin_token: str | None,
        draining: asyncio.Event,
    ) -> None:
        self.endpoints = endpoints
        self.admin_token = admin_token
        self.draining = draining
        self._paths: dict[tuple[EndpointId, str], str] = {}  # adapter -> path loaded from

    def _authorize(self, request: web.Request) -> None:
        token = self.admin_token
        if not token:
            return
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        try:  # aiohttp keeps undecodable header bytes as lone surrogates
            given_bytes = given.encode()
        except UnicodeEncodeError:
            given_bytes = b""
        if scheme.lower() != "bearer" or not hmac.compare_digest(given_bytes, token.encode()):
            raise ApiError(
                401,
                "A valid admin token is required: send `Authorization: Bearer <token>`.",
                code="invalid_api_key",
            )

    def _endpoint(self, name: str | None) -> Endpoint:
        serving = [ep for ep in self.endpoints.values() if ep.serving]
        if name is not None:
            for ep in serving:
                if str(ep.id) == name:
                    return ep
            raise ApiError(404, f"no endpoint {name!r} is served here", param="endpoint")
        if len(serving) != 1:
            raise ApiError(400, "this worker serves several endpoints: name one", param="endpoint")
        return serving[0]

    async def list_loras(self, request: web.Request) -> web.Response:
        """Every adapter attached, described and encoded `LISTED_PER_TURN` per turn of the
        event loop (of the models attached when it began: one detached meanwhile is listed)."""
        pieces: list[bytes] = []
        for ep in list(self.endpoints.values()):
            models = list(ep.models.items())
            for start in range(0, len(models), LISTED_PER_TURN):
                if start:
                    await asyncio.sleep(0)
                loras = [
                    _lora_body(
                        ep,
                        att.card.display_name,
                        suffix,
                        path=self._paths.get((ep.id, suffix)),
                        att=att,
                    )
                    for suffix, att in models[start : start + LISTED_PER_TURN]
                    if suffix is not None and att.card.lora is not None
                ]
                if loras:
                    pieces.append(_encoder.encode(loras)[1:-1])  # (the list's items)
            await asyncio.sleep(0)
        body = b'{"object":"list","data":[' + b",".join(pieces) + b"]}"
        return web.Response(body=body, content_type="application/json")

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
            raise ApiError(400, "name must not be empty", param="name")
        if self.draining.is_set():
            raise ApiError(503, "the worker is draining")
        ep = self._endpoint(body.endpoint)
        assert ep.engine is not None
        try:
            suffix = adapter_suffix(body.name)
        except ValueError as exc:
            raise ApiError(400, f"invalid adapter name: {exc}", param="name") from None
        async with ep.sync_lock:
            held = ep.models.get(suffix)
            if held is not None:
                return self._reloaded(ep, held, body, suffix)
            try:
                served = await ep.engine.load_adapter(body.name, body.path)
            except EngineUnavailableError as exc:
                raise ApiError(501, str(exc)) from None
            except ValueError as exc:
                raise ApiError(400, str(exc), param="name") from None
            try:
                await ep.attach_served(served)
            except (StoreError, OSError, ModelConflictError, CollisionError, ValueError) as exc:
                await _unload_quietly(ep, body.name)
                status = 503 if isinstance(exc, StoreError | OSError) else 409
                raise ApiError(status, f"could not announce adapter: {exc}") from None
            self._paths[(ep.id, suffix)] = body.path
        return web.json_response(_lora_body(ep, body.name, suffix, path=body.path))

    def _reloaded(self, ep: Endpoint, held: Attached, body: LoadLora, suffix: str) -> web.Response:
        """A load of a suffix already attached: 200 if it is the same load, else 409."""
        path = self._paths.get((ep.id, suffix))
        if held.card.display_name != body.name:
            raise ApiError(
                409,
                f"adapter {body.name!r} would take suffix {suffix!r}, held by "
                f"{held.card.display_name!r}",
                param="name",
            )
        if path != body.path:
            loaded = "by its engine" if path is None else f"from {redact_url(path)!r}"
            raise ApiError(
                409,
                f"adapter {body.name!r} is already loaded {loaded}: unload it before "
                f"loading it from {redact_url(body.path)!r}",
                param="name",
            )
        return web.json_response(_lora_body(ep, body.name, suffix, path=path))

    async def unload_lora(self, request: web.Request) -> web.Response:
        self._authorize(request)
        name = request.match_info["name"]
        try:
            suffix = adapter_suffix(name)
        except ValueError:
            raise ApiError(404, f"no adapter {name!r} is loaded", param="name") from None
        for ep in self.endpoints.values():
            att = ep.models.get(suffix)
            if att is None or att.card.lora is None or att.card.display_name != name:
                continue
            if ep.engine is None or not ep.engine.unloads_adapters:
                engine = "" if ep.engine is None else f" {ep.engine.name}"
                raise ApiError(
                    501,
                    f"adapter {name!r} was not unloaded: the engine{engine} cannot unload "
                    "adapters (unload it on the server that lists it)",
                    param="name",
                )
            async with ep.sync_lock:
                if ep.models.get(suffix) is not att:  # (unloaded while this one waited)
                    raise ApiError(404, f"no adapter {name!r} is loaded", param="name")
                await ep.detach_model(suffix)  # discovery first, then metadata
                try:
                    await ep.engine.unload_adapter(name)
                except Exception as exc:
                    # Still loaded: announce it again, as it was, and say why.
                    await ep.reattach(suffix, att)
                    raise ApiError(
                        409, f"adapter {name!r} was not unloaded: {exc}", param="name"
                    ) from None
                self._paths.pop((ep.id, suffix), None)
            return web.json_response({"object": "lora", "name": name, "deleted": True})
        raise ApiError(404, f"no adapter {name!r} is loaded", param="name", code="not_found")


async def _unload_quietly(ep: Endpoint, name: str) -> None:
    if ep.engine is None:
        return
    try:
        await ep.engine.unload_adapter(name)
    except Exception as exc:
        log.warning("engine %s: unloading adapter %r failed: %s", ep.engine.name, name, exc)


def _lora_body(
    ep: Endpoint,
    name: str,
    suffix: str | None,
    path: str | None = None,
    att: Attached | None = None,
) -> dict[str, Any]:
    """An adapter as the routes describe it: `att` attached at `suffix` (else the one there)."""
    att = att or ep.models.get(suffix)
    body: dict[str, Any] = {
        "object": "lora",
        "name": name,
        "suffix": suffix,
        "endpoint": str(ep.id),
        "base_model": att.card.lora.base_model if att and att.card.lora else None,
        "mdcsum": att.card.mdcsum if att else None,
    }
    if path is not None:  # (listed without a token: a URL's credentials never shown)
        body["path"] = redact_url(path)
    return body
