"""The frontend's HTTP surface: which handler a request goes to, and the small ones.

Routes: the OpenAI request routes go to the proxy; `/v1/models` (`listings.py`), `/live`,
`/ready`, `/health`, `/health/controllers` and `/metrics` are small handlers on the same server.
`/live` is the liveness probe (503 only while shutting down), `/ready` the readiness probe
(503 with reasons while starting, draining, or a control loop is stuck on its own work; never
for the store or a worker, which every replica shares), and `/health` a report for people
(200 once started, whatever the store's state). `/health/controllers` reports every loop in
trouble and the store's outage.
`/v1/membership` and `/v1/membership/status` are served when the scope follows a membership
watch, to an operator only (they name the whole scope): a team's key (`--auth keys`) is
refused there.

Exposure: with API keys, `/health` shows its details only to a caller with a key (or to
anyone with `public_health`); with `metrics_port`, `/metrics` is served there alone (plain
HTTP, for a scraper), not on the API's port.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import hmac
import itertools
import logging
import operator
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, cast

import msgspec

from shoal.bounds import MAX_LISTED, first_listed
from shoal.cards import ModelType
from shoal.controllers import ControllerManager, readiness
from shoal.discovery import Discovery
from shoal.discovery.grants import Grant
from shoal.frontend.config import FrontendConfig, MembershipFollower
from shoal.frontend.dashboard.dashboard import Dashboard
from shoal.frontend.http import errors
from shoal.frontend.http.cors import Cors
from shoal.frontend.http.listener import HttpServer
from shoal.frontend.http.request import Request, bearer_token
from shoal.frontend.http.server import HttpConnection
from shoal.frontend.keys.gate import Gate
from shoal.frontend.keys.keys import KeyRing
from shoal.frontend.keys.limits import Limits
from shoal.frontend.keys.usage import UsageBook
from shoal.frontend.keys.windows import estimate
from shoal.frontend.listings import Listings
from shoal.frontend.proxy.fields import (
    LARGE_BODY,
    Fields,
    WithTokens,
    decode_fields,
    fields_later,
)
from shoal.frontend.proxy.proxy import Proxy
from shoal.frontend.registry.metrics import FrontendMetrics
from shoal.frontend.registry.registry import Model, Registry
from shoal.frontend.registry.router import Router
from shoal.frontend.registry.watcher import ModelWatcher
from shoal.frontend.virtual.virtual import LiveInstances, RouteTable
from shoal.openai import ApiError

log = logging.getLogger(__name__)

PROXY_ROUTES = {
    b"/v1/chat/completions": ModelType.CHAT,
    b"/v1/completions": ModelType.COMPLETIONS,
    b"/v1/embeddings": ModelType.EMBEDDINGS,
}
HEALTH_MODELS = 100  # models `/health` describes (it counts them all; `/ui` shows more)
OTHER_BODY = 64 * 1024  # with keys required: the most body any request but a proxied one sends
_json = msgspec.json.encode
_instance_id = operator.attrgetter("instance_id")


class Endpoints:
    """The frontend's routes (`handle`) and the small handlers on its server. `Frontend`
    builds and owns the state they read, declared here."""

    config: FrontendConfig
    registry: Registry
    routes: RouteTable
    router: Router
    proxy: Proxy
    gate: Gate
    keys: KeyRing | None
    _keys: tuple[bytes, ...]  # the `--api-key` keys
    limits: Limits
    usage: UsageBook | None
    cors: Cors | None
    manager: ControllerManager
    dashboard: Dashboard
    watcher: ModelWatcher | None
    membership: MembershipFollower | None
    _membership_factory: Callable[[Discovery], MembershipFollower] | None
    scope_loaded: bool  # the first selection's namespaces have had their first listing
    metrics: FrontendMetrics
    metrics_server: HttpServer | None  # `/metrics` alone, on `metrics_port`
    metrics_source: Callable[[], Awaitable[bytes | list[bytes]]] | None
    draining: bool
    listings: Listings  # `/v1/models`
    _health_body: tuple[int, dict[str, Any]] | None

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
                # (no key configured, the default: nothing to check, and no call to say so)
                grant = None if self.keys is None and not self._keys else self._authorize(request)
                if grant is not None:
                    # Its fields, decoded once for the gate and the proxy: a large body in
                    # the decoder process, then admitted from there (`_admit_later`).
                    prompt = self.router.needs_prompt
                    if request.size >= LARGE_BODY:  # (its pieces joined there too)
                        done = functools.partial(self._admit_later, request, conn, kind, grant)
                        members = self.proxy.may_rebuild()  # (decoded in the same pass)
                        fields_later(
                            request,
                            conn,
                            done,
                            with_prompt=prompt,
                            with_tokens=True,
                            with_members=members,
                        )
                        return
                    fields = decode_fields(
                        request.body,
                        with_prompt=prompt,
                        too_deep=request.too_deep,
                        with_tokens=True,
                    )
                    self._admit(request, conn, kind, grant, fields)
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

    def _admit(
        self,
        request: Request,
        conn: HttpConnection,
        kind: ModelType,
        grant: Grant,
        fields: WithTokens,
    ) -> None:
        """A key's request, its `fields` decoded: to the gate (`ApiError` 403 for a model
        the key may not use, before the model is looked up)."""
        model = fields.model or ""
        KeyRing.admit(grant, model)
        # its tpm estimate, once, of the members just decoded (a few bytes)
        tokens = estimate(
            request.size, fields.max_completion_tokens, fields.max_tokens, fields.n,
            fields.best_of,
        )  # fmt: skip
        # (a stream: the engine's usage charged)
        asked = self.proxy.ask_usage(request, fields, grant.workspace)
        self.gate.handle(request, conn, kind, grant, model, tokens, fields, hide_usage=asked)

    def _admit_later(
        self,
        request: Request,
        conn: HttpConnection,
        kind: ModelType,
        grant: Grant,
        fields: Fields | ApiError,
    ) -> None:
        """`_admit` of a large body's fields, decoded in a thread (`fields_later`); answers
        what `handle` would have (a bug: 500, as the server answers one in `handle`)."""
        try:
            if isinstance(fields, ApiError):
                conn.send_error(fields)
            else:
                self._admit(request, conn, kind, grant, cast(WithTokens, fields))
        except ApiError as exc:
            conn.send_error(exc)
        except Exception:
            log.exception("request %s failed", request.path.decode("latin-1"))
            conn.keep_alive = False
            conn.send_error(errors.internal_error())

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

    def check_head(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]
    ) -> ApiError | int:
        """The 401 a request to a proxied route gets, told from its head alone (the server
        asks before it reads the body: buffering `max_body` for anyone cost 16 MiB a
        connection), with the CORS lines an allowed page needs to read it; else the most body
        bytes the request may send: `max_body` to a proxied route, `OTHER_BODY` to any other
        (none reads more: 16 MiB to /v1/models or an unknown path were buffered for anyone)."""
        if method != b"POST":
            return OTHER_BODY
        request = Request(method, target, headers, b"", keep_alive=False, http11=True)
        if request.path not in PROXY_ROUTES:  # (its path: an absolute-form target's too)
            return OTHER_BODY
        try:
            self._authorize(request)
        except ApiError as exc:
            origin = request.header(b"origin")
            if self.cors is not None and origin is not None and self.cors.allows(origin):
                exc.headers += _cors_lines(self.cors.response_headers(origin))
            return exc.with_traceback(None)  # (its frames hold the request, and it: a cycle)
        return self.config.max_body

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
            listing = self.listings.listing(self._authorize(request))
            if isinstance(listing, bytes):
                conn.send(200, listing)
            else:
                _AnswerLater(conn, listing, _JSON_TYPE)
        elif path.startswith(b"/v1/models/"):
            grant = self._authorize(request)
            name = urllib.parse.unquote(path[len(b"/v1/models/") :].decode())
            conn.send(200, self.listings.model(name, grant))
        elif path == b"/live":
            if self.draining:
                conn.send(503, _json({"status": "shutting down"}))
            else:
                conn.send(200, _json({"status": "ok"}))
        elif path == b"/ready":
            status, body = self.readiness()
            conn.send(status, _json(body))
        elif path == b"/health":
            detailed = self.config.public_health or self._authorized(request)
            status, body = self.health(detailed)
            if not detailed:
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
            if not self._authorized(request):  # an operator's: it names the whole fleet,
                raise errors.unauthorized()  # not a route for a team's key (`--auth keys`)
            if self.membership is None:
                raise errors.not_found(path.decode())
            if path == b"/v1/membership":
                _AnswerLater(conn, self.membership.view.json(), _JSON_TYPE)
            else:
                conn.send(200, _json(self.membership.status.to_dict()))
        elif path == b"/metrics" and self.metrics_server is None:
            source = self.metrics_source or self.metrics.render_sliced
            _AnswerLater(conn, source())
        else:
            raise errors.not_found(path.decode())

    def _health_fleet(self) -> dict[str, Any]:
        """`/health`'s models and instances, bounded at any fleet size and encoded again only
        after the registry changed: at most `HEALTH_MODELS` models (those not serving or
        incomplete first, then by name), each worker set naming at most `MAX_LISTED` of its
        routable instances (the smallest ids); the totals count them all."""
        cached = self._health_body
        version = self.registry.version
        if cached is not None and cached[0] == version:
            return cached[1]
        models = self.registry.models
        trouble = [name for name, m in models.items() if not m.serving or m.incomplete]
        not_serving = sum(1 for name in trouble if not models[name].serving)
        names = heapq.nsmallest(HEALTH_MODELS, trouble)
        if len(names) < HEALTH_MODELS:
            chosen = set(names)
            rest = (name for name in models if name not in chosen)
            names += heapq.nsmallest(HEALTH_MODELS - len(names), rest)
        # An instance is one id, in the sets of every model it serves; an adapter card may
        # give it a second upstream (another URL), which is still the same instance.
        sets = (ws.routable for m in models.values() for ws in m.sets.values())
        instances = set(map(_instance_id, itertools.chain.from_iterable(sets)))
        fleet = {
            "models_total": len(models),
            "models_not_serving": not_serving,
            "models_incomplete": len(trouble) - not_serving,  # serving, a worker set waits
            "models": {name: _health_model(models[name]) for name in sorted(names)},
            "instances": len(instances),
        }
        self._health_body = (version, fleet)
        return fleet

    def _serve_metrics(self, request: Request, conn: HttpConnection) -> None:
        """The `metrics_port` server's one route."""
        if request.path != b"/metrics":
            error = errors.not_found(request.path.decode())
        elif request.method not in (b"GET", b"HEAD"):
            error = errors.method_not_allowed(
                request.method.decode(), "/metrics", (b"GET", b"HEAD")
            )
        else:
            _AnswerLater(conn, self.metrics.render_sliced())
            return
        conn.send(error.status, error.body(), headers=error.headers)

    def _fleet_loaded(self) -> bool:
        """Whether the registry holds the fleet: the first discovery listing loaded (and,
        following a membership, its first selection's namespaces)."""
        if self.watcher is None or not self.watcher.snapshot_loaded.is_set():
            return False
        return self._membership_factory is None or self.scope_loaded

    def _live_instances(self) -> LiveInstances:
        """Instances by model name, discovered and virtual (a virtual model wins a name),
        each counted when read."""
        return self.routes.live_instances()

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
        elif self._membership_factory is not None and not self.scope_loaded:
            reasons["membership"] = f"loading {self.watcher.loading()} namespaces"
        reasons.update(self.manager.stuck())
        if reasons:
            return 503, {"status": "not ready", "reasons": reasons}
        return 200, {"status": "ready"}

    def health(self, detailed: bool = True) -> tuple[int, dict[str, Any]]:
        """503 while starting or draining; else 200 with what the registry knows (not
        `detailed`: the status alone, what a caller without the API key is told; the details
        describe every workspace's routes, 8 ms a call at 10 workspaces of 10,000)."""
        if self.draining:
            return 503, {"status": "draining"}
        if self.watcher is None:
            return 503, {"status": "starting"}
        if not self.watcher.snapshot_loaded.is_set():
            return 503, {"status": "starting", "loading": self.watcher.progress()}
        if not detailed:
            return 200, {"status": "ok"}
        fleet = self._health_fleet()
        incomplete = self.watcher.incomplete()
        listed = heapq.nsmallest(MAX_LISTED, incomplete, key=lambda r: r.model.key.key)
        return 200, {
            "status": "ok",
            "store": self.watcher.store.report(),
            **fleet,
            "incomplete_total": len(incomplete),
            "incomplete": [
                {"key": str(r.model.key), "state": r.state.value, "error": r.error} for r in listed
            ],
            "metadata_cache": self.watcher.cache.status(),
            "routing": self.router.describe(),
            "skipped_total": len(self.watcher.discovery.skipped),
            "skipped": first_listed(self.watcher.discovery.skipped),
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


class _AnswerLater:
    """An answer produced by an awaitable (`/metrics` written a slice of models at a time, or
    the merged metrics of several processes; `/v1/membership` encoded in a thread); cancelled
    if the client goes away, 503 if the awaitable fails."""

    def __init__(
        self, conn: HttpConnection, body: Awaitable[bytes | list[bytes]], kind: bytes | None = None
    ) -> None:
        self.task = asyncio.ensure_future(self._answer(conn, body, kind or _METRICS_TYPE))
        conn.produce_later(self)

    @staticmethod
    async def _answer(
        conn: HttpConnection, body: Awaitable[bytes | list[bytes]], kind: bytes
    ) -> None:
        try:
            data = await body
        except Exception as exc:
            error = errors.unavailable(f"the frontend's answer could not be made: {exc}")
            conn.send(error.status, error.body(), headers=error.headers)
        else:
            if isinstance(data, bytes):
                conn.send(200, data, kind)
            else:  # (the pieces, as written: never joined)
                conn.send_pieces(200, data, kind)

    def cancel(self) -> None:
        self.task.cancel()


_METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_JSON_TYPE = b"application/json"
_PUBLIC_HEALTH = frozenset({"status", "reasons"})
"""What `/health` tells a caller without the API key (unless `--public-health`)."""

_CONTROL_PATHS = frozenset(
    {b"/live", b"/ready", b"/health", b"/health/controllers", b"/metrics"}
    | {b"/v1/membership", b"/v1/membership/status"}
)


def _cors_lines(lines: bytes) -> tuple[tuple[bytes, bytes], ...]:
    """Encoded header lines (`Cors.response_headers`) as (name, value) pairs."""
    pairs = (line.partition(b": ") for line in lines.split(b"\r\n") if line)
    return tuple((name, value) for name, _, value in pairs)


def _health_model(model: Model) -> dict[str, Any]:
    return {
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
                "routable": len(ws.routable),
                "instances": [
                    f"{i:x}" for i in heapq.nsmallest(MAX_LISTED, map(_instance_id, ws.routable))
                ],
                "members": len(ws.members),
            }
            for ws in model.sets.values()
        ],
    }
