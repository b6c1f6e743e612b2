"""The `openai` sidecar engine: fronts an existing OpenAI-compatible server.

vLLM, SGLang, the llama.cpp server and Ollama already speak the OpenAI API; this engine
announces the models the server lists while it is healthy and forwards requests to it
byte for byte, streaming the response back as it arrives.

The sidecar authenticates to the upstream with its own key (never the client's), and
follows no redirects: a redirect would turn a POST into a bodiless GET, so it is reported
as a misconfigured upstream URL instead.

In disaggregated serving it announces the `role` it is given (a vLLM prefill or decode
server with the NixlConnector behind it); `kv_transfer_params` cross it unchanged both
ways, as every byte of a request and its answer does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, NoReturn
from urllib.parse import urljoin, urlsplit

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict

from shoal.bounds import MAX_DEPTH, TooDeep, check_json_depth, read_at_most
from shoal.cards import WorkerRole
from shoal.discovery.keys import quoted
from shoal.kv import KvEndpoint
from shoal.openai import ApiError
from shoal.slices import decoded_slices
from shoal.urls import redact_url
from shoal.worker.engine import Engine, EngineUnavailableError, ServedModel
from shoal.worker.protocol import openai_errors

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH = 4096
DEFAULT_MAX_BODY = 16 * 1024 * 1024
"""Bytes of a request body forwarded at most by default: the gateway's own default limit
(`shoal frontend --max-body`), so whatever a frontend lets through reaches the upstream."""
PROBE_TIMEOUT = 5.0
"""Seconds a health probe may take before the upstream counts as unhealthy."""
HEALTH_WAIT = 0.5
"""Seconds `check_health` (the worker's `/health`, a readiness probe given 1 s) waits for a
probe of the upstream, its own or one in flight, before answering what the last probe found:
a probe of a slow upstream may take two `PROBE_TIMEOUT`s, and it goes on meanwhile (it made
`/health` take 3.2 s behind an upstream answering each GET in 1.6 s)."""
MAX_MODELS_BODY = 4 << 20
"""Bytes of a `/v1/models` reply read at most: a longer one makes the upstream unhealthy
(a listing of 30,000 models is 13 MB; read, decoded and parsed every probe it held the
event loop ~600 ms)."""
MAX_MODELS_ENTRIES = 65_536
"""Entries of a `/v1/models` reply's `data` taken at most; more makes the upstream unhealthy."""
PARSE_SLICE_BYTES = 64 << 10
"""Bytes of a `/v1/models` reply's entries decoded in one step on the event loop (64 KiB is
~6,000 short entries: a few ms). msgspec decodes in one C call holding the GIL, so a thread
would not spare the loop: a larger reply is read with its entries left encoded (one pass that
skips them), then decoded a slice at a time, yielding between (`shoal.slices`). One entry over
this makes the upstream unhealthy."""
PARSE_SLICE_ENTRIES = 1024
"""Entries parsed, and models compared with those held, in one step on the event loop."""
NAMED_IN_ERRORS = 10
"""Model names an unhealthy reason names at most (then how many more)."""

FORWARDED_ROUTES = (
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/models"),
)

# Headers that describe one hop of the connection, not the request: never forwarded.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# The client's credentials are for this worker, not for the upstream: the upstream gets the
# sidecar's own key (`api_key`), or none.
_NOT_FORWARDED_REQUEST = _HOP_BY_HOP | {"host", "content-length", "authorization"}
_NOT_REDIRECTS = frozenset({300, 304})


class OpenAISidecarEngine(Engine):
    """Serve the models of an OpenAI-compatible server at `upstream_url`.

    `served_models()` lists the upstream's models while it is healthy and nothing when it
    is not, so the runtime withdraws them from discovery. With `model`, only that model
    (and the LoRA adapters the upstream lists on it) is announced, and an upstream that
    does not list it is unhealthy. Health and model probes are cached for
    `health_interval` seconds and never generate. `request_timeout` bounds a whole
    forwarded request (None: no limit, generations can be long). `api_key` is sent to the
    upstream as a Bearer token; the client's own `Authorization` never is. Request bodies
    up to `max_body` bytes are forwarded byte for byte; a larger one is answered 413.

    A model's identity is its name, not the URL it is reached at: replicas of one model
    behind different upstream servers announce identical cards.

    A client disconnect cancels the upstream request when the app is served with
    handler cancellation on (`web.AppRunner(app, handler_cancellation=True)`); without
    it, the upstream request is cancelled at the next chunk that cannot be written.
    """

    name = "openai"

    def __init__(
        self,
        upstream_url: str,
        *,
        model: str | None = None,
        health_interval: float = 2.0,
        request_timeout: float | None = None,
        api_key: str | None = None,
        kv_events_endpoint: str | None = None,
        kv_replay_endpoint: str | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        role: WorkerRole | str = WorkerRole.AGGREGATED,
    ) -> None:
        if max_body <= 0:
            raise ValueError(f"max_body must be positive, got {max_body}")
        self.role = WorkerRole(role)  # announced on every card: the stage the upstream serves
        self.upstream = normalize_upstream(upstream_url)
        self.max_body = max_body
        # The fronted server's own KV event sockets, advertised as they are: subscribers
        # read vLLM's stream (and replay) directly, with no extra hop or copy.
        self._kv_events = (
            KvEndpoint(publisher=kv_events_endpoint, replay=kv_replay_endpoint or "")
            if kv_events_endpoint
            else None
        )
        self.model = model or None
        self.health_interval = health_interval
        self.request_timeout = request_timeout
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._probe_lock = asyncio.Lock()
        self._health_probe: asyncio.Task[None] | None = None  # the probe `check_health` began
        self._probed_at = -math.inf
        self._models: list[ServedModel] = []
        self._listing: bytes | None = None  # the `/v1/models` reply `_models` were made of
        self._unavailable: str | None = "the upstream has not been checked yet"
        self._health_route_missing = False
        self._in_flight = 0

    @property
    def kv_events(self) -> KvEndpoint | None:
        return self._kv_events

    async def start(self) -> None:
        """Open the connection pool and probe the upstream once.

        An upstream that is down (still loading, say) is not an error: its models are
        announced once it answers.
        """
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None),
                auto_decompress=False,
                # Send exactly the headers the client sent, no defaults of our own.
                skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            )
        await self._refresh(max_age=0.0)
        if self._unavailable is not None:
            log.warning("upstream %s is not ready yet: %s", self.upstream, self._unavailable)

    async def stop(self) -> None:
        if self._health_probe is not None:
            self._health_probe.cancel()
            self._health_probe = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._models, self._listing = [], None
        self._unavailable = "the engine is stopped"
        self._probed_at = -math.inf

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def served_models(self) -> list[ServedModel]:
        await self._refresh(max_age=self.health_interval)
        return list(self._models)

    async def check_health(self) -> None:
        """What the last probe found, after a probe if that one is over `health_interval`
        old; waits at most `HEALTH_WAIT` for it (or the probe in flight), which goes on."""
        probe = self._health_probe
        if probe is None or probe.done():
            refresh = self._refresh(max_age=self.health_interval)
            probe = self._health_probe = asyncio.create_task(refresh, name="sidecar:probe")
        await asyncio.wait([probe], timeout=HEALTH_WAIT)
        if probe.done() and not probe.cancelled():
            probe.result()  # (what no probe should raise, raised here)
        if self._unavailable is not None:
            raise EngineUnavailableError(self._unavailable)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors], client_max_size=self.max_body)
        for method, path in FORWARDED_ROUTES:
            app.router.add_route(method, path, self._forward)
        return app

    # -- health --------------------------------------------------------------------------

    async def _refresh(self, *, max_age: float) -> None:
        """Probe the upstream unless a probe finished less than `max_age` seconds ago."""
        async with self._probe_lock:
            if time.monotonic() - self._probed_at < max_age:
                return
            try:
                self._models, self._listing = await self._probe()
                if self._unavailable is not None:
                    log.info("upstream %s is healthy", self.upstream)
                self._unavailable = None
            except EngineUnavailableError as exc:
                if self._unavailable is None:
                    log.warning("upstream %s is unhealthy: %s", self.upstream, exc)
                self._models, self._listing = [], None
                self._unavailable = str(exc)
            self._probed_at = time.monotonic()

    async def _probe(self) -> tuple[list[ServedModel], bytes]:
        """`GET /health` (when the server has it), then `GET /v1/models`; never a generation.
        The models listed, and the reply they were made of."""
        if not self._health_route_missing:
            status, _ = await self._get("/health")
            if status in (404, 405):
                log.info("upstream %s has no /health; probing /v1/models", self.upstream)
                self._health_route_missing = True
            elif not 200 <= status < 300:
                raise EngineUnavailableError(f"GET {self.upstream}/health answered {status}")
        status, body = await self._get("/v1/models")
        if not 200 <= status < 300:
            raise EngineUnavailableError(f"GET {self.upstream}/v1/models answered {status}")
        if body == self._listing:  # the very bytes of the last reply: the very same models
            return self._models, body
        return await self._models_of(body, self._models), body

    async def _models_of(self, body: bytes, held: list[ServedModel]) -> list[ServedModel]:
        """The models `body` lists, decoded and parsed a slice at a time (`PARSE_SLICE_BYTES`,
        `PARSE_SLICE_ENTRIES`), yielding between (60,000 in one go held the loop ~175 ms); one
        listed as `held` is that very object, not a new one (20,000 made anew and dropped at
        each change were what the garbage collector scanned, holding the GIL: 90-150 ms)."""
        data = await self._decode_models(body)
        by_name = {model.name: model for model in held}
        models: dict[str, ServedModel] = {}
        for start in range(0, len(data), PARSE_SLICE_ENTRIES):
            if start:
                await asyncio.sleep(0)
            self._parse_models(data[start : start + PARSE_SLICE_ENTRIES], models, by_name)
        return self._select(models)

    async def _decode_models(self, body: bytes) -> list[_Entry]:
        """The entries of a `/v1/models` reply. Only `id`, `max_model_len` and `parent` of an
        entry are decoded (msgspec skips the rest: a 5 MB listing in ~10 ms, not json.loads's
        ~70 ms), a slice of `PARSE_SLICE_BYTES` at a time."""
        try:
            if len(body) <= PARSE_SLICE_BYTES:
                check_json_depth(body)  # (a deeper reply raised RecursionError)
                data = _listing_decoder.decode(body).data
            else:
                data = await self._decode_in_slices(body)
        except (ValueError, msgspec.DecodeError) as exc:
            raise EngineUnavailableError(
                f"GET {self.upstream}/v1/models failed: {str(exc) or type(exc).__name__}"
            ) from None
        if data is None:
            raise EngineUnavailableError(f"GET {self.upstream}/v1/models has no `data` list")
        if len(data) > MAX_MODELS_ENTRIES:
            self._too_many(len(data))
        return data

    def _too_many(self, entries: int) -> NoReturn:
        raise EngineUnavailableError(
            f"GET {self.upstream}/v1/models lists {entries:,} entries, more than the "
            f"{MAX_MODELS_ENTRIES:,} the sidecar takes"
        )

    async def _decode_in_slices(self, body: bytes) -> list[_Entry] | None:
        """(Each slice's depth is checked as it is decoded: the whole reply's, 4 MiB of
        brackets, took ~12 ms; the pass skipping the entries stops at the interpreter's
        recursion limit, said as the error it is.)"""
        try:
            raws = _raw_listing_decoder.decode(body).data
        except RecursionError:
            raise TooDeep(MAX_DEPTH) from None
        if raws is None:
            return None
        if len(raws) > MAX_MODELS_ENTRIES:
            self._too_many(len(raws))  # (refused undecoded)
        data: list[_Entry] = []
        limit = PARSE_SLICE_BYTES
        async for entries in decoded_slices(
            raws, _entries_decoder, slice_bytes=limit, item_bytes=limit
        ):
            data += entries
        return data

    async def _get(self, path: str) -> tuple[int, bytes]:
        if self._session is None:
            raise EngineUnavailableError("the engine is not started")
        url = self.upstream + path
        try:
            async with self._session.get(
                url,
                headers=self._auth,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT),
            ) as response:
                if is_redirect(response.status):
                    raise EngineUnavailableError(
                        f"GET {url} redirected ({response.status}) to "
                        f"{redirect_target(response)}: set --upstream to the URL the server "
                        "answers at (the sidecar follows no redirects)"
                    )
                if not 200 <= response.status < 300 or path == "/health":
                    return response.status, b""
                return response.status, await _read_bounded(response, url)
        except TimeoutError:
            raise EngineUnavailableError(
                f"GET {url} did not answer within {PROBE_TIMEOUT}s"
            ) from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise EngineUnavailableError(
                f"GET {url} failed: {str(exc) or type(exc).__name__}"
            ) from None

    def _parse_models(
        self, data: list[_Entry], models: dict[str, ServedModel], held: dict[str, ServedModel]
    ) -> None:
        """Add the models `data` lists to `models` (the first of each name); one listed as
        `held` is that very object."""
        for entry in data:
            if not isinstance(entry, _ListedModel):
                continue
            model_id = entry.id
            if not isinstance(model_id, str) or not model_id or model_id in models:
                continue
            max_len = entry.max_model_len
            context_length = (
                max_len
                if isinstance(max_len, int) and not isinstance(max_len, bool) and max_len > 0
                else DEFAULT_CONTEXT_LENGTH
            )
            # vLLM lists a LoRA adapter with `parent` naming its base model.
            parent = entry.parent
            is_adapter = isinstance(parent, str) and parent and parent != model_id
            adapter, base = (model_id, parent) if is_adapter else (None, None)
            old = held.get(model_id)
            if (
                old is not None
                and old.context_length == context_length
                and old.adapter == adapter
                and old.base_model == base
                and old.role is self.role
            ):
                models[model_id] = old  # (the other fields are this parser's, as made)
                continue
            models[model_id] = ServedModel(
                name=model_id,
                source=f"openai:{model_id}",
                context_length=context_length,
                adapter=adapter,
                base_model=base,
                role=self.role,
            )

    def _select(self, models: dict[str, ServedModel]) -> list[ServedModel]:
        """All `models`, or with `self.model` that one and its adapters (unhealthy if absent)."""
        if self.model is None:
            return list(models.values())
        chosen = models.get(self.model)
        if chosen is None:
            listed = _some_names(models)
            raise EngineUnavailableError(
                f"GET {self.upstream}/v1/models does not list {self.model!r} (it lists "
                f"{listed}): check --model, or wait for the server to load it"
            )
        adapters = [m for m in models.values() if m.base_model == self.model]
        return [chosen, *(m for m in adapters if m is not chosen)]

    # -- forwarding ----------------------------------------------------------------------

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        """Forward the request as it came; stream the response back as it arrives."""
        self._in_flight += 1
        try:
            return await self._forward_one(request)
        finally:
            self._in_flight -= 1

    async def _forward_one(self, request: web.Request) -> web.StreamResponse:
        session = self._session
        if session is None:
            raise ApiError(503, "The openai engine is not started.", code="engine_stopped")
        body = await request.read()
        headers: CIMultiDict[str] = CIMultiDict()
        for name, value in request.headers.items():
            if name.lower() not in _NOT_FORWARDED_REQUEST:
                headers.add(name, value)
        headers.update(self._auth)
        url = self.upstream + request.rel_url.raw_path_qs
        try:
            upstream = await session.request(
                request.method,
                url,
                data=body,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
            )
        except TimeoutError:
            raise ApiError(
                504,
                f"The upstream server {self.upstream} did not answer within "
                f"{self.request_timeout}s.",
                type="server_error",
                code="upstream_timeout",
            ) from None
        except aiohttp.ClientError as exc:
            raise ApiError(
                502,
                f"The upstream server {self.upstream} is unreachable: {exc}",
                type="server_error",
                code="upstream_unavailable",
            ) from None
        if is_redirect(upstream.status):
            upstream.close()
            raise ApiError(
                502,
                f"The upstream server answered {request.method} {url} with a redirect "
                f"({upstream.status}) to {redirect_target(upstream)}; the sidecar follows no "
                "redirects: set its --upstream to the URL the server answers at.",
                type="server_error",
                code="upstream_redirect",
            )

        # Any exit before the upstream body is complete closes the upstream connection: a
        # client disconnect (cancellation or a failed write) is how OpenAI servers learn
        # to abort the generation.
        complete = False
        try:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    response.headers.add(name, value)
            await response.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    # The status line is gone already: cut the client's connection so it
                    # sees a truncated response, never a complete-looking one.
                    log.warning("upstream %s failed mid-response: %r", self.upstream, exc)
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                if not chunk:
                    break
                await response.write(chunk)
            complete = True
            await response.write_eof()
            return response
        finally:
            if complete:
                upstream.release()
            else:
                upstream.close()


class _ListedModel(msgspec.Struct, gc=False):  # (decoded JSON: no cycles)
    """What the sidecar reads of a `/v1/models` entry (any JSON value each)."""

    id: Any = None
    max_model_len: Any = None
    parent: Any = None


# (an entry that is no object is skipped, as one without a string `id`)
_Entry = _ListedModel | str | int | float | bool | None


class _Listing(msgspec.Struct):
    data: list[_Entry] | None = None


class _RawListing(msgspec.Struct):
    data: list[msgspec.Raw] | None = None


_listing_decoder = msgspec.json.Decoder(_Listing)
_raw_listing_decoder = msgspec.json.Decoder(_RawListing)
_entries_decoder = msgspec.json.Decoder(list[_Entry])


async def _read_bounded(response: aiohttp.ClientResponse, url: str) -> bytes:
    """The reply's body, refused (the upstream unhealthy) past `MAX_MODELS_BODY` bytes."""
    raw = await read_at_most(response, MAX_MODELS_BODY)
    if raw is None:
        raise EngineUnavailableError(
            f"GET {url} answered more than {MAX_MODELS_BODY:,} bytes: too many models listed"
        )
    return raw


def _some_names(models: dict[str, ServedModel]) -> str:
    """The first `NAMED_IN_ERRORS` names (sorted, each quoted and cut) and how many more."""
    if not models:
        return "nothing"
    names = sorted(models)
    named = ", ".join(quoted(name) for name in names[:NAMED_IN_ERRORS])
    more = len(names) - NAMED_IN_ERRORS
    return f"{len(names):,} models: {named}" + (f" and {more:,} more" if more > 0 else "")


def is_redirect(status: int) -> bool:
    """A 3xx that sends the client elsewhere (301, 302, 303, 307, 308)."""
    return 300 <= status < 400 and status not in _NOT_REDIRECTS


def redirect_target(response: aiohttp.ClientResponse) -> str:
    """Where a redirect points, as an absolute URL (or a placeholder when it does not say),
    without what may hold a secret (a login proxy's redirect carries credentials, a signed
    query): it shows in `/health`, the logs and a client's 502."""
    location = response.headers.get("Location")
    if not location:
        return "(no Location header)"
    return redact_url(urljoin(str(response.url), location))


def normalize_upstream(url: str) -> str:
    """`http://host:8000/v1/` -> `http://host:8000`: the server root, without `/v1`.

    A URL with credentials (`http://user:password@host`) or a query is refused, without
    repeating them: the URL shows in errors, `/health` and logs; the key goes in `api_key`.
    """
    parts = urlsplit(url.strip())
    if "@" in parts.netloc:
        raise ValueError(
            "the upstream URL must not carry credentials (user:password@host): give the "
            "upstream's key with --upstream-api-key (SHOAL_UPSTREAM_API_KEY) instead"
        )
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"upstream URL must be http(s)://host[:port], got {redact_url(url)!r}")
    if parts.query or parts.fragment:  # (a key put there would be dropped, and shown)
        raise ValueError(
            f"the upstream URL {redact_url(url)!r} must not carry a query or a fragment: give "
            "the upstream's key with --upstream-api-key (SHOAL_UPSTREAM_API_KEY) instead"
        )
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"
