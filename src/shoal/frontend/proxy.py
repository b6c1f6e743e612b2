"""The request path: read `model` and `stream`, pick an instance, forward, stream back.

The body is forwarded as it came; only the fields routing needs are decoded (a tiny msgspec
`Struct`). The response is streamed to the client as it arrives, re-framed as chunked when
the worker sent it chunked, without parsing SSE.

A `Forward` carries one request through all of this, driven by callbacks: from the client's
packet to the worker's answer it creates no task and no future (only opening a new upstream
connection awaits). Per request: one small JSON decode, one routing pick, one write each
way, a few counter increments.

Failure handling: a connect error, a transport error or a 5xx before the first response
byte reached the client marks the instance down for `inhibit_seconds` and tries another
(up to `retries` more attempts). So does an instance that sends no response byte within
`first_byte_timeout` of the request (it hangs, or is stuck): one timer handle per attempt,
cancelled when the response head arrives; when no instance answers in time the client gets
504. After the first byte, a failure ends an SSE stream with an error event. A client that
disconnects cancels the handler, which drops the upstream connection so the worker stops
generating.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from shoal.cards import ModelType
from shoal.frontend import errors
from shoal.frontend.errors import ApiError
from shoal.frontend.metrics import UNKNOWN_MODEL, FrontendMetrics, ModelStats
from shoal.frontend.registry import Model, Registry
from shoal.frontend.router import Router
from shoal.frontend.server import HttpConnection, Request, status_line
from shoal.frontend.upstream import Upstream, UpstreamConnection, UpstreamError

log = logging.getLogger(__name__)

PROMPT_CHARS = 8192  # how much of the prompt prefix-aware routing looks at

# Not forwarded upstream: hop-by-hop headers, and those the proxy sets itself.
_REQUEST_HEADERS_DROPPED = frozenset(
    {
        b"host",
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"upgrade",
        b"expect",
    }
)
_RESPONSE_HEADERS_DROPPED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
    }
)


class FirstByteTimeout(UpstreamError):
    """An instance sent no response byte within the first-byte timeout."""


class Fields(msgspec.Struct):
    """The only parts of a request body the gateway reads."""

    model: str | None = None
    stream: bool | None = None


class _Message(msgspec.Struct):
    role: str = ""
    content: Any = None


class PromptFields(Fields):
    """`Fields` and the prompt, for prefix-aware routing."""

    messages: list[_Message] | None = None
    prompt: Any = None
    input: Any = None


_decode_fields = msgspec.json.Decoder(Fields).decode
_decode_prompt_fields = msgspec.json.Decoder(PromptFields).decode


def decode_fields(body: bytes, *, with_prompt: bool = False) -> Fields:
    """The routing fields of a body; `ApiError` 400 if it is not a JSON object with a `model`."""
    try:
        fields = _decode_prompt_fields(body) if with_prompt else _decode_fields(body)
    except msgspec.ValidationError as exc:
        raise errors.bad_request(f"Invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise errors.bad_request(f"The request body is not valid JSON: {exc}") from None
    if not fields.model:
        raise errors.bad_request("You must provide a model parameter.", param="model")
    return fields


def prompt_text(fields: Fields, limit: int = PROMPT_CHARS) -> str:
    """The start of the prompt as text: chat messages, a completion prompt or embedding input."""
    if not isinstance(fields, PromptFields):
        return ""
    parts: list[str] = []
    size = 0
    if fields.messages:
        for message in fields.messages:
            content = message.content
            if isinstance(content, list):
                content = "".join(
                    p.get("text", "") for p in content if isinstance(p, dict) and p.get("text")
                )
            text = f"{message.role}:{content if isinstance(content, str) else ''}\n"
            parts.append(text)
            size += len(text)
            if size >= limit:
                break
        return "".join(parts)[:limit]
    value = fields.prompt if fields.prompt is not None else fields.input
    if isinstance(value, list) and value:
        value = value[0] if isinstance(value[0], str | list) else value
    if isinstance(value, list):
        value = ",".join(str(token) for token in value[: limit // 4])
    return value[:limit] if isinstance(value, str) else ""


class Forward:
    """One request on its way: pick an instance, send, stream the answer back, retry early failures.

    It is the `ResponseSink` of the upstream connection carrying the current attempt, and
    the `current` work of the client connection, which cancels it if the client goes away.
    Output is gathered while one packet from the worker is parsed and written once (`flush`).
    `started` turns True when the first byte reached the client: from then on a failure
    cannot be retried, and a stream ends with an SSE error event instead.
    """

    __slots__ = (
        "attempt",
        "body_seen",
        "chunked",
        "client",
        "conn",
        "connecting",
        "done",
        "fields",
        "head_seen",
        "model",
        "out",
        "prompt",
        "proxy",
        "request",
        "started",
        "stats",
        "status",
        "stream",
        "target",
        "timer",
        "tried",
    )

    def __init__(
        self,
        proxy: Proxy,
        request: Request,
        client: HttpConnection,
        model: Model,
        fields: Fields,
        stats: ModelStats,
    ) -> None:
        self.proxy = proxy
        self.request = request
        self.client = client
        self.model = model
        self.fields = fields
        self.stats = stats
        self.stream = bool(fields.stream)
        router = proxy.router
        self.prompt = (router.prompt_of or prompt_text)(fields) if router.needs_prompt else None
        self.tried: list[Upstream] = []
        self.attempt = 0
        self.target: Upstream | None = None
        self.conn: UpstreamConnection | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None  # the first-byte timeout of the attempt
        self.out: list[bytes] = []
        self.status = 0
        self.chunked = False
        self.head_seen = False
        self.body_seen = False
        self.started = False
        self.done = False

    def start(self) -> None:
        self.stats.in_flight += 1
        self.client.current = self
        self._attempt(None)

    # -- attempts ----------------------------------------------------------------------------

    def _attempt(self, failure: Exception | None) -> None:
        """Send to the next instance; after the last one, answer with the failure."""
        target = None
        if self.attempt <= self.proxy.retries:
            target = self.proxy.pick(self.model, self.prompt, self.tried)
        if target is None:
            name = self.model.name
            if failure is None:
                error = errors.no_ready_instance(name)
            elif isinstance(failure, FirstByteTimeout):
                error = errors.upstream_timeout(name, self.proxy.first_byte_timeout)
            else:
                error = errors.upstream_failed(name, str(failure))
            self._finish(error)
            return
        if self.attempt:
            self.stats.retries += 1
        self.attempt += 1
        self.target = target
        target.in_flight += 1
        conn = target.take_idle()
        if conn is None:
            self.connecting = asyncio.create_task(self._connect(target))
        else:
            self._send(conn)

    async def _connect(self, target: Upstream) -> None:
        """The only await of the request path: opening a connection when none is idle."""
        try:
            conn = await target.connect()
        except Exception as exc:
            self.connecting = None
            self._attempt_failed(exc)
            return
        self.connecting = None
        self._send(conn)

    def _send(self, conn: UpstreamConnection) -> None:
        assert self.target is not None
        self.conn = conn
        self.out = []
        self.head_seen = False
        self.chunked = False
        client = self.client
        client.flow = conn
        if client.writing_paused:
            conn.pause_reading()
        conn.send(self.proxy.request_head(self.request, self.target), self.request.body, self)
        if self.proxy.first_byte_timeout > 0:
            self.timer = client.server.loop.call_later(
                self.proxy.first_byte_timeout, self._first_byte_timed_out
            )

    def _first_byte_timed_out(self) -> None:
        """No response byte within the first-byte timeout: drop the connection, try elsewhere."""
        self.timer = None
        conn = self.conn
        if self.done or conn is None or self.head_seen or conn.received:
            return
        if conn.paused:  # held back by a slow client, not by the instance: wait on
            self.timer = self.client.server.loop.call_later(
                self.proxy.first_byte_timeout, self._first_byte_timed_out
            )
            return
        assert self.target is not None
        self.conn = None  # (not mistaken for an idle connection the worker had closed)
        conn.abort()
        seconds = self.proxy.first_byte_timeout
        self._attempt_failed(
            FirstByteTimeout(f"instance {self.target.url} sent nothing within {seconds:g}s")
        )

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _attempt_failed(self, failure: Exception) -> None:
        """The attempt failed before any byte reached the client: try elsewhere."""
        self._disarm()
        target, conn = self.target, self.conn
        assert target is not None
        self.conn = None
        self.client.flow = None
        if conn is not None and conn.reused and not self.head_seen:
            # An idle connection the worker had closed: not the instance's fault.
            self.connecting = asyncio.create_task(self._connect(target))
            return
        target.in_flight -= 1
        self.target = None
        log.warning("%s; trying another instance", failure)
        target.inhibit(self.proxy.inhibit_seconds)
        self.proxy.metrics.instances_inhibited.inc()
        self.tried.append(target)
        self._attempt(failure)

    def _may_retry(self) -> bool:
        """Whether a 5xx is worth another attempt: attempts left, and an instance not tried."""
        if self.attempt > self.proxy.retries:
            return False
        tried = [*self.tried, self.target]
        return any(u not in tried for ws in self.model.routable_sets for u in ws.routable)

    # -- ResponseSink ------------------------------------------------------------------------

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], chunked: bool) -> bool:
        self.head_seen = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if status >= 500 and self._may_retry():
            assert self.target is not None
            self._attempt_failed(UpstreamError(f"instance {self.target.url} answered {status}"))
            return False
        client = self.client
        self.status = status
        parts = [status_line(status)]
        for name, value in headers:
            if name.lower() not in _RESPONSE_HEADERS_DROPPED:
                parts += (name, b": ", value, b"\r\n")
        if chunked:
            if self.request.http11:
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                client.keep_alive = False  # an HTTP/1.0 client: the body ends with the connection
        if not client.keep_alive:
            parts.append(b"connection: close\r\n")
        assert self.target is not None
        parts += (b"x-shoal-instance: ", self.target.label, b"\r\n\r\n")
        self.out.append(b"".join(parts))
        return True

    def on_body(self, data: bytes) -> None:
        if not self.body_seen:
            self.body_seen = True
            if self.stream:
                self.stats.ttft.observe(time.perf_counter() - self.request.received)
        if self.chunked:
            self.out += (b"%x\r\n" % len(data), data, b"\r\n")
        else:
            self.out.append(data)

    def flush(self) -> None:
        if not self.out:
            return
        data = self.out[0] if len(self.out) == 1 else b"".join(self.out)
        self.out = []
        if self.client.writable:
            self.started = True
            self.client.write(data)

    def on_complete(self) -> None:
        if self.chunked:
            self.out.append(b"0\r\n\r\n")
        self.flush()
        self._end_attempt()
        self._finish(None)

    def on_failure(self, exc: Exception) -> None:
        if not self.started:
            self._attempt_failed(exc)
            return
        self.flush()
        self._end_attempt()
        self._break_off(exc)
        self._finish(None)

    # -- the end -----------------------------------------------------------------------------

    def cancel(self) -> None:
        """The client went away: drop the upstream connection, so the worker stops too."""
        if self.done:
            return
        if self.connecting is not None:
            self.connecting.cancel()
        if self.conn is not None:
            self.conn.abort()
        self._end_attempt()
        self.status = 499
        self._finish(None)

    def _end_attempt(self) -> None:
        self._disarm()
        if self.target is not None:
            self.target.in_flight -= 1
            self.target = None
        self.conn = None
        self.client.flow = None

    def _break_off(self, failure: Exception) -> None:
        """A response failed after its first byte reached the client."""
        log.warning("response for %s broke off: %s", self.model.name, failure)
        if self.chunked and self.stream and self.client.writable:
            event = b"data: " + errors.error_body(
                f"The model instance failed while streaming: {failure}",
                type="server_error",
                code="upstream_error",
            ) + b"\n\n"  # fmt: skip
            self.client.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
        else:
            self.client.keep_alive = False  # the body is cut short: only closing tells the client

    def _finish(self, error: ApiError | None) -> None:
        self.done = True
        stats = self.stats
        stats.in_flight -= 1
        stats.count(error.status if error is not None else self.status)
        stats.duration.observe(time.perf_counter() - self.request.received)
        client = self.client
        client.current = None
        if error is not None and not client.response_started:
            client.send_error(error)
        else:
            client.end()


class Proxy:
    """Forwards OpenAI requests to instances of the requested model."""

    def __init__(
        self,
        registry: Registry,
        router: Router,
        metrics: FrontendMetrics,
        *,
        retries: int = 2,
        inhibit_seconds: float = 5.0,
        first_byte_timeout: float = 60.0,
        strip_authorization: bool = False,
    ) -> None:
        self.registry = registry
        self.router = router
        self.metrics = metrics
        self.retries = retries
        self.inhibit_seconds = inhibit_seconds
        self.first_byte_timeout = first_byte_timeout  # 0: no limit
        dropped = set(_REQUEST_HEADERS_DROPPED)
        if strip_authorization:
            dropped.add(b"authorization")  # the gateway's own key is not the worker's business
        self._dropped = frozenset(dropped)

    def handle(self, request: Request, client: HttpConnection, kind: ModelType) -> None:
        """Start answering one request of `kind` (chat, completions, embeddings)."""
        try:
            fields = decode_fields(request.body, with_prompt=self.router.needs_prompt)
        except ApiError as exc:
            self._refuse(client, exc, UNKNOWN_MODEL)
            return
        name = fields.model or ""
        model = self.registry.models.get(name)
        if model is None:
            self._refuse(client, errors.model_not_found(name), UNKNOWN_MODEL)
        elif not model.serving:
            self._refuse(client, errors.no_ready_instance(name), name)
        elif kind not in model.model_types:
            message = f"The model `{name}` does not serve {kind} requests."
            self._refuse(client, errors.bad_request(message, param="model"), name)
        else:
            Forward(self, request, client, model, fields, self.metrics.model(name)).start()

    def _refuse(self, client: HttpConnection, error: ApiError, label: str) -> None:
        self.metrics.model(label).count(error.status)
        client.send_error(error)

    def pick(self, model: Model, prompt: str | None, tried: list[Upstream]) -> Upstream | None:
        """An instance of `model` not in `tried`: a set weighted by size, then the policy."""
        ws = model.pick_set()
        if ws is None:
            return None
        target = self.router.pick(ws, prompt, tried)
        if target is None and len(model.routable_sets) > 1:
            for other in model.routable_sets:
                if other is not ws and (target := self.router.pick(other, prompt, tried)):
                    break
        return target

    def request_head(self, request: Request, target: Upstream) -> bytes:
        """The request line and headers for `target`: hop-by-hop headers dropped, length set."""
        parts = [request.method, b" ", target.path_prefix, request.path]
        if request.query:
            parts += (b"?", request.query)
        parts += (
            b" HTTP/1.1\r\nhost: ",
            target.host_header,
            b"\r\ncontent-length: ",
            str(len(request.body)).encode(),
            b"\r\n",
        )
        dropped = self._dropped
        for name, value in request.headers:
            if name not in dropped:
                parts += (name, b": ", value, b"\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)
