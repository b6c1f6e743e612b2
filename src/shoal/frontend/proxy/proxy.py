"""The request path: read `model` and `stream`, pick an instance, forward, stream back.

The body is forwarded as it came; only the fields routing needs are decoded (a tiny msgspec
`Struct`). A request for a virtual model goes to one of its targets, and its body is
re-encoded only when that target serves the model under another name (`VirtualForward`).
The response is streamed to the client as it arrives, re-framed as chunked when the worker
sent it chunked, without parsing SSE (but for a stream that may migrate, see `migration`).

`Proxy.handle` is the entry point: it refuses what cannot be served and starts a `Forward`
(forward.py; `VirtualForward`, routed.py, for a virtual model) for the rest; the fields it
reads of the body are `fields.py`'s, the headers it passes on `headers.py`'s.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Callable
from typing import Protocol

from shoal.cards import ModelType
from shoal.frontend.http import errors
from shoal.frontend.http.request import ClientConnection, Request
from shoal.frontend.http.upstream import Upstream
from shoal.frontend.proxy.deadlines import Deadlines
from shoal.frontend.proxy.fields import (
    LARGE_BODY,
    NO_KV_TRANSFER_PARAMS,
    Fields,
    WithTokens,
    asking_usage,
    decode_fields,
    fields_later,
)
from shoal.frontend.proxy.forward import Forward
from shoal.frontend.proxy.headers import (
    ACCEPT_IDENTITY,
    MAX_GATEWAY_HOPS,
    PROVIDER_HEADERS,
    REQUEST_HEADERS_DROPPED,
    hop_by_hop,
)
from shoal.frontend.proxy.migration import CHAT_PATH, COMPLETIONS_PATH
from shoal.frontend.proxy.routed import VirtualForward
from shoal.frontend.registry.metrics import UNKNOWN_MODEL, FrontendMetrics, ModelStats
from shoal.frontend.registry.registry import Model, Registry
from shoal.frontend.registry.router import Router
from shoal.frontend.virtual.virtual import RouteTable, VirtualModel
from shoal.openai import ApiError

log = logging.getLogger(__name__)


class TwoStageStarter(Protocol):
    """Starts a request for a model served in two stages (`frontend/proxy/disagg.TwoStages`)."""

    def start(
        self,
        request: Request,
        client: ClientConnection,
        model: Model,
        fields: Fields,
        stats: ModelStats,
        kind: ModelType,
        *,
        served: str | None = None,
    ) -> None: ...


class Proxy:
    """Forwards OpenAI requests to instances of the requested model: `handle` is the entry
    point, a `Forward` (below) carries each request from there."""

    def __init__(
        self,
        registry: Registry,
        router: Router,
        metrics: FrontendMetrics,
        *,
        retries: int = 2,
        inhibit_seconds: float = 5.0,
        first_byte_timeout: float = 60.0,
        upstream_idle_timeout: float = 60.0,
        strip_authorization: bool = False,
        routes: RouteTable | None = None,
        migration_limit: int = 1,
    ) -> None:
        self.registry = registry
        # Whether what the registry holds is the fleet (the first discovery listing loaded):
        # until then a model it does not hold yet is 503, retry, not 404 (a frontend
        # restarted on its port under load answered 404 for live models while it loaded).
        self.loaded: Callable[[], bool] = _always
        self.routes = routes
        self.router = router
        self.metrics = metrics
        self.retries = retries
        self.inhibit_seconds = inhibit_seconds
        self.first_byte_timeout = first_byte_timeout  # 0: no limit
        self.upstream_idle_timeout = upstream_idle_timeout  # 0: no limit
        self.migration_limit = migration_limit  # continuations per stream (migration.py); 0: off
        # Both timeouts, swept for every attempt in flight by one timer (deadlines.py).
        timeouts = (first_byte_timeout, upstream_idle_timeout)
        self.deadlines = Deadlines(*timeouts) if max(timeouts) > 0 else None
        dropped = set(REQUEST_HEADERS_DROPPED)
        if strip_authorization:
            dropped.add(b"authorization")  # the gateway's own key is not the worker's business
        self._dropped = frozenset(dropped)
        self._dropped_with_authorization = self._dropped | {b"authorization"}
        # This gateway's name in `Via`: random, so a request that comes back is recognised.
        self.gateway = "shoal-" + secrets.token_hex(8)
        self._gateway = self.gateway.encode()
        self.via = b"via: 1.1 " + self._gateway + b"\r\n"
        # Models served in two stages (prefill, then decode): `frontend/proxy/disagg.TwoStages`,
        # which builds on this module, set by the frontend.
        self.two_stages: TwoStageStarter | None = None

    def handle(
        self,
        request: Request,
        client: ClientConnection,
        kind: ModelType,
        fields: Fields | None = None,
        workspace: str | None = None,
    ) -> None:
        """Start answering one request of `kind` (chat, completions, embeddings); `fields`:
        its body's, when the caller decoded them (a key's request: `decode_fields` with the
        router's `needs_prompt`); `workspace`: its key's (its model is looked for among that
        workspace's virtual models alone, `virtual_model`), None without a team's key. A body
        of `LARGE_BODY` or more is decoded in the decoder process (`fields_later`), and
        answered from here when that is done. Nothing raises out of here: a bug answers 500
        in the OpenAI format, counted like any answer (a `Forward` once started answers for
        itself)."""
        try:
            if fields is None:
                if request.size >= LARGE_BODY:  # (its pieces joined in the decoder's thread)
                    done = functools.partial(self._decoded, request, client, kind, workspace)
                    prompt, members = self.router.needs_prompt, self.may_rebuild()
                    fields_later(request, client, done, with_prompt=prompt, with_members=members)
                    return
                try:
                    fields = decode_fields(
                        request.body,
                        with_prompt=self.router.needs_prompt,
                        too_deep=request.too_deep,
                    )
                except ApiError as exc:
                    self._refuse(client, exc, UNKNOWN_MODEL)
                    return
            name = fields.model or ""
            params = fields.kv_transfer_params
            if params is not NO_KV_TRANSFER_PARAMS and bytes(params) != b"null":
                self._refuse(client, errors.client_kv_transfer_params(), UNKNOWN_MODEL)
                return
            virtual = self.virtual_model(name, workspace)
            if (looped := self._looped(request)) is not None:
                known = virtual is not None or name in self.registry.models
                self._refuse(client, looped, name if known else UNKNOWN_MODEL)
                return
            if virtual is not None:
                self._route(request, client, kind, fields, virtual)
                return
            model = self.registry.models.get(name)
            if (
                model is not None
                and kind in model.model_types
                and (narrowed := model.for_kind(kind)) is not None
                and narrowed.routable_sets
                and narrowed.stages is None
            ):  # the common case, in fewer steps: what `_start` concludes for it
                Forward(self, request, client, narrowed, fields, self.metrics.model(name)).start()
            else:
                self._start(request, client, kind, fields, name, model)
        except Exception:
            log.exception("request %s failed in the gateway", request.path.decode("latin-1"))
            self._refuse(client, errors.internal_error(), UNKNOWN_MODEL)

    def _decoded(
        self,
        request: Request,
        client: ClientConnection,
        kind: ModelType,
        workspace: str | None,
        fields: Fields | ApiError,
    ) -> None:
        """A large body's fields, decoded in a thread (`fields_later`): answer as `handle`."""
        if isinstance(fields, ApiError):
            self._refuse(client, fields, UNKNOWN_MODEL)
        else:
            self.handle(request, client, kind, fields, workspace)

    def virtual_model(self, name: str, workspace: str | None) -> VirtualModel | None:
        """The virtual model a request for `name` goes to, `workspace` being its key's (None:
        no team's key), as every path resolves it (`RouteTable.lookup`); None: no route of
        that name is visible to it, and the discovered model of the name, if any, serves it."""
        routes = self.routes
        return None if routes is None else routes.lookup(name, workspace)

    def _start(
        self,
        request: Request,
        client: ClientConnection,
        kind: ModelType,
        fields: Fields,
        name: str,
        model: Model | None,
    ) -> None:
        """Refuse what `model` cannot serve, start the rest."""
        if model is None:
            error = (
                errors.model_not_found(name) if self.loaded() else errors.discovery_loading(name)
            )
            self._refuse(client, error, UNKNOWN_MODEL)
        elif not model.serving:
            self._refuse(client, errors.no_ready_instance(name, model.incomplete), name)
        elif kind not in model.model_types:
            message = f"The model `{name}` does not serve {kind} requests."
            self._refuse(client, errors.bad_request(message, param="model"), name)
        elif (narrowed := model.for_kind(kind)) is None or not narrowed.serving:
            # instances that serve the model, but none of them declares this kind
            self._refuse(client, errors.no_ready_instance(name), name)
        elif narrowed.stages is not None and self.two_stages is not None:  # disaggregated
            self.two_stages.start(request, client, narrowed, fields, self.metrics.model(name), kind)
        else:
            Forward(self, request, client, narrowed, fields, self.metrics.model(name)).start()

    def _route(
        self,
        request: Request,
        client: ClientConnection,
        kind: ModelType,
        fields: Fields,
        virtual: VirtualModel,
    ) -> None:
        """Start answering a request for a virtual model."""
        name = virtual.name
        if name in self.registry.models and self.routes is not None:
            self.routes.shadows(name)  # a clash with a discovered model is logged once
        staged = virtual.staged(kind) if self.two_stages is not None else None
        if staged is not None and self.two_stages is not None:  # an alias of a disaggregated model
            model, served = staged
            stats = self.metrics.model(name)
            self.two_stages.start(request, client, model, fields, stats, kind, served=served)
        elif virtual.accepts(kind):  # (with no instance now, the first pick answers 503)
            stats = self.metrics.model(name)
            VirtualForward(self, request, client, virtual, kind, fields, stats).start()
        elif not virtual.serving:
            self._refuse(client, errors.no_ready_instance(name), name)
        else:
            message = f"The model `{name}` does not serve {kind} requests."
            self._refuse(client, errors.bad_request(message, param="model"), name)

    def ask_usage(self, request: Request, fields: WithTokens, workspace: str | None) -> bool:
        """Whether a key's request, a streamed chat or text completion its client asked no
        usage event of, now asks its engine for one (the body rewritten: `asking_usage`): the
        key is charged the engine's count, and `Metered` keeps the event from the client. Not
        for a virtual model with a provider among its targets: an OpenAI-compatible API may
        refuse the member (Mistral's answers 422), and charges as it sends. Nor for an HTTP/1.0
        client (nginx's default to its upstreams): its stream is not chunked, the event could
        not be told apart in it, and the client saw it."""
        if not fields.stream or (request.path != CHAT_PATH and request.path != COMPLETIONS_PATH):
            return False
        if not request.http11:
            return False
        virtual = self.virtual_model(fields.model or "", workspace)
        if virtual is not None and not virtual.fleet_only:
            return False
        body = asking_usage(request.body, fields.stream_options, request.members)
        if body is None:
            return False
        request.rewrite(body)
        return True

    def may_rebuild(self) -> bool:
        """Whether a request's body may be sent rebuilt from its top-level members: a virtual
        model renames the model for a target (`VirtualForward`), or a model is served in two
        stages (disagg.py). A large body's members are then decoded with its fields, in one
        pass (`fields_later`); else not: with a prompt for the router, they cost a second
        pass over its messages."""
        if self.routes is not None and self.routes.renaming:  # (of any workspace)
            return True
        models = self.registry.models.values()
        return self.two_stages is not None and any(m.stages is not None for m in models)

    def _looped(self, request: Request) -> ApiError | None:
        """508 when the request's `Via` names this gateway, or `MAX_GATEWAY_HOPS` shoal ones."""
        hops = 0
        for name, value in request.headers:
            if name == b"via":
                hops += value.count(b" shoal-")
                if self._gateway in value:
                    return errors.loop_detected(self.gateway, hops)
        if hops >= MAX_GATEWAY_HOPS:
            return errors.too_many_hops(hops, MAX_GATEWAY_HOPS)
        return None

    def _refuse(self, client: ClientConnection, error: ApiError, label: str) -> None:
        self.metrics.model(label).count(error.status)
        client.send_error(error)

    def pick(self, model: Model, prompt: str | None, tried: list[Upstream]) -> Upstream | None:
        """An instance of `model` not in `tried` (see `Router.choose`)."""
        return self.router.choose(model, prompt, tried)

    def request_head(self, request: Request, target: Upstream, body: bytes) -> bytes:
        """The request line and headers for `target` and `body`: hop-by-hop headers dropped,
        length set, the answer asked for uncompressed, this gateway's `Via` added. A provider
        gets only `PROVIDER_HEADERS` of the client's, never its `Authorization`, only its own."""
        path = request.path
        if target.path_skip:
            path = path[target.path_skip :]
        parts = [request.method, b" ", target.path_prefix, path]
        if request.query:
            parts += (b"?", request.query)
        parts += (
            b" HTTP/1.1\r\nhost: ",
            target.host_header,
            b"\r\ncontent-length: ",
            b"%d" % len(body),
            b"\r\n",
            ACCEPT_IDENTITY,
        )
        if target.authorization is not None:  # the instance URL's credentials, a provider's secret
            parts += (b"authorization: ", target.authorization, b"\r\n")
        if target.provider:
            hop = hop_by_hop(b",".join(v for k, v in request.headers if k == b"connection"))
            for name, value in request.headers:
                if name in PROVIDER_HEADERS and name not in hop:
                    parts += (name, b": ", value, b"\r\n")
            parts += (self.via, b"\r\n")
            return b"".join(parts)
        if target.authorization is not None:
            dropped = self._dropped_with_authorization
        else:
            dropped = self._dropped
        mark = len(parts)
        listed: bytes | None = None  # the client's `Connection:` value
        for name, value in request.headers:
            if name not in dropped:
                parts += (name, b": ", value, b"\r\n")
            elif name == b"connection":
                listed = value if listed is None else listed + b"," + value
        if listed is not None and (hop := hop_by_hop(listed)):
            del parts[mark:]
            for name, value in request.headers:
                if name not in dropped and name not in hop:
                    parts += (name, b": ", value, b"\r\n")
        parts += (self.via, b"\r\n")
        return b"".join(parts)


def _always() -> bool:
    return True
