"""Disaggregated serving: a request in two stages, in vLLM's NixlConnector protocol.

1. Stage one goes to a prefill instance (picked by the routing policy, `kv` included): the
   client's body with `max_tokens: 1` (and `max_completion_tokens: 1` when given),
   `stream: false`, no `stream_options`, and `kv_transfer_params` asking for a remote decode
   (`do_remote_decode: true`, `do_remote_prefill: false`, the rest null), under an
   `X-Request-Id` the frontend makes, new for each prefill (vLLM's connector matches a KV
   transfer by it: two requests a client sent under one id must not meet on an instance).
   Its whole answer is read (at most `MAX_PREFILL_ANSWER` bytes) for its `kv_transfer_params`.
2. The client's body with those `kv_transfer_params` goes to a decode instance (the least
   loaded) under the prefill's `X-Request-Id`, and its answer is relayed as any answer is
   (`Forward`), streamed or not: the usage the client sees is the decode's, counted once.
   The client's own `X-Request-Id` names the request in the logs, and an answer's
   `X-Request-Id` (an engine echoing the stage's) is given back as the client's.

Failover (docs/gateway.md): a failed prefill is inhibited and another tried; an answer over
`MAX_PREFILL_ANSWER` (what the request asked for: `n` choices) fails that request alone. A decode that
fails before the first byte is retried on another decode with a new prefill, unless it was
never reached (a refused connect): then the same handle goes to the next decode. A decode
that refuses the handle (a 400 naming `kv_transfer_params`) counts as that prefill's
failure. A client that leaves during stage one cancels it. Embeddings go whole to a prefill.

Both stages' bodies are made of the client's top-level members (`msgspec.Raw`: its messages
stay the bytes it sent), decoded once; a large body's (`fields.LARGE_BODY`) are decoded in the
decoder process and each stage's body encoded from them in the decoder's thread, never on the
event loop (`fields.members_of`, `fields.encode_members`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from shoal.cards import ModelType
from shoal.frontend.http import errors
from shoal.frontend.http.exchange import (
    ConnectRefused,
    OutOfFiles,
    UpstreamError,
    UpstreamTimeout,
)
from shoal.frontend.http.request import ClientConnection, Request
from shoal.frontend.http.upstream import Upstream, UpstreamConnection
from shoal.frontend.proxy.fields import (
    Fields,
    Members,
    encode_members,
    members_of,
    rewrite_model,
)
from shoal.frontend.proxy.forward import Forward
from shoal.frontend.proxy.proxy import Proxy
from shoal.frontend.proxy.stages import (
    api_error,
    prefill_handle,
    refuses_handle,
    stage_one,
    stage_two,
)
from shoal.frontend.registry.metrics import TTFT_BUCKETS, Histogram, ModelStats
from shoal.frontend.registry.registry import Model
from shoal.frontend.registry.router import LeastLoaded
from shoal.openai import ApiError

log = logging.getLogger(__name__)

MAX_PREFILL_ANSWER = 1 << 20  # bytes of a stage-one answer read (one token and the params)
MAX_PEEK = 64 * 1024  # bytes of a decode's 400 read to see whether it refuses the KV handle


class StageStats(Collector):
    """Per stage figures on `/metrics`: prefill time, decode time to first byte, failures."""

    def __init__(self) -> None:
        self.prefill = Histogram(TTFT_BUCKETS)
        self.decode_ttft = Histogram(TTFT_BUCKETS)
        self.failures = {"prefill": 0, "decode": 0}

    def collect(self) -> Iterator[Metric]:
        prefill = HistogramMetricFamily(
            "shoal_frontend_disagg_prefill_seconds",
            "Disaggregated requests: time of the prefill stage (send to whole answer).",
        )
        prefill.add_metric([], self.prefill.buckets(), self.prefill.sum)
        decode = HistogramMetricFamily(
            "shoal_frontend_disagg_decode_ttft_seconds",
            "Disaggregated requests: time from sending the decode stage to its first byte "
            "(the KV handoff wait included).",
        )
        decode.add_metric([], self.decode_ttft.buckets(), self.decode_ttft.sum)
        failures = CounterMetricFamily(
            "shoal_frontend_disagg_stage_failures",
            "Disaggregated requests: stage attempts that failed and were retried or answered.",
            labels=["stage"],
        )
        for stage, count in self.failures.items():
            failures.add_metric([stage], count)
        yield from (prefill, decode, failures)


class TwoStages:
    """What the proxy needs for disaggregated requests: the decode picker and the figures."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.decode_router = LeastLoaded()  # decode is memory-bound: by load, not by prefix
        self.stats = StageStats()
        proxy.metrics.registry.register(self.stats)
        self._ids = itertools.count()
        self._prefix = os.urandom(4).hex()

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
    ) -> None:
        """Start a request for `model`; `served`: the name the workers serve it as, when the
        request names a virtual model (an alias) of it. An embeddings request has nothing to
        decode: it goes whole to a prefill instance (the one pass over its prompt)."""
        if kind is not ModelType.EMBEDDINGS:
            TwoStageForward(self, request, client, model, fields, stats, served).start()
            return
        assert model.stages is not None
        forward = Forward(self.proxy, request, client, model.stages.prefill, fields, stats)
        if served is not None and served != fields.model:
            forward.body = rewrite_model(request.body, served, request.members)
        forward.start()

    def request_id(self) -> bytes:
        return f"shoal-{self._prefix}-{next(self._ids):x}".encode()


class PrefillSink:
    """Receives a stage-one answer whole (it is small) into a future, or its failure."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.done: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        # A failure is kept here, not as the future's exception: raised from the future, its
        # traceback holds `answer`'s frame, which holds this sink and so the future, a
        # reference cycle (`_failure` hands it over as it is raised).
        self.failure: Exception | None = None
        self.head: asyncio.Future[None] = loop.create_future()
        self.status = 0
        self.parts: list[bytes] = []
        self.size = 0
        self.head_seen = False
        self.sent = self.last_read = time.monotonic()  # (last_read: of the last byte)
        self.begun: asyncio.Future[None] = loop.create_future()  # a byte of the answer came

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], chunked: bool) -> bool:
        self.head_seen = True
        self.last_read = time.monotonic()
        self.status = status
        if not self.head.done():
            self.head.set_result(None)
        return True

    async def answer(self, address: str, first_byte: float, idle: float) -> tuple[int, bytes]:
        """The whole answer: its head within `first_byte` seconds of the send, then no more
        than `idle` seconds without a byte (0: no bound), else `UpstreamError`. With no
        `first_byte` bound, the idle one holds from the answer's first byte."""
        while not self.done.done():
            idling = self.head_seen or (first_byte <= 0 and self.begun.done())
            limit = idle if idling else first_byte
            since = self.last_read if idling else self.sent
            left = since + limit - time.monotonic() if limit > 0 else None
            if left is not None and left <= 0:
                what = "stalled for" if idling else "sent no answer within"
                self.done.cancel()  # (the connection's end is nobody's to read)
                raise UpstreamTimeout(f"prefill instance {address} {what} {limit:g}s")
            waits: set[asyncio.Future[Any]] = {self.done}
            if not self.head_seen:  # (the bound changes with the head, or its first byte)
                waits.add(self.head)
                if not self.begun.done():
                    waits.add(self.begun)
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if self.failure is not None:
            raise self._failure()
        return self.done.result()

    def _failure(self) -> Exception:
        """The failure, no longer held here (see `__init__`)."""
        failure, self.failure = self.failure, None
        assert failure is not None
        return failure

    def on_body(self, data: bytes) -> None:
        self.last_read = time.monotonic()
        self.size += len(data)
        if self.size > MAX_PREFILL_ANSWER:
            self.on_failure(AnswerTooLong(f"prefill answer over {MAX_PREFILL_ANSWER} bytes"))
        else:
            self.parts.append(data)

    def on_packet(self, bodies: list[bytes]) -> None:
        for data in bodies:
            self.on_body(data)
        self.last_read = time.monotonic()
        if not self.begun.done():
            self.begun.set_result(None)

    def on_complete(self) -> None:
        if not self.done.done():
            self.done.set_result((self.status, b"".join(self.parts)))

    def on_failure(self, exc: Exception) -> None:
        if not self.done.done():
            self.failure = exc
            self.done.set_result((0, b""))


class TwoStageForward(Forward):
    """A request for a model served in two stages: each attempt is a prefill (a task: the
    one place this path awaits more than a connect), then the decode, relayed by `Forward`."""

    __slots__ = (
        "decode_body",
        "members",
        "pairsum",
        "peek",
        "peeked",
        "prefill_body",
        "prefilled_by",
        "refused",
        "sent_at",
        "served",
        "source",
        "stage_request",
        "stages",
        "staging",
    )

    def __init__(
        self,
        stages: TwoStages,
        request: Request,
        client: ClientConnection,
        model: Model,
        fields: Fields,
        stats: ModelStats,
        served: str | None = None,
    ) -> None:
        super().__init__(stages.proxy, request, client, model, fields, stats)
        self.stages = stages
        self.served = served or self.name  # the model's name on the workers
        # What both stages are made of: the client's top-level members, naming the model as
        # the workers serve it (`_members`, decoded once); the body they are, when known.
        self.members: Members | None = None
        self.source: bytes | None = request.body if self.served == self.name else None
        self.prefill_body: bytes | None = None  # stage one's, the same for every prefill
        self.decode_body = request.body  # stage two's, for the handle in hand
        self.staging: asyncio.Task[None] | None = None
        self.prefilled_by: Upstream | None = None  # None: the next decode needs a new prefill
        self.pairsum = ""  # the checksum of the pair that prefilled: its decodes only take it
        self.refused: list[Upstream] = []  # decodes that refused a handle: others first
        self.peek: list[bytes] | None = None  # a decode's 400, read before it is relayed
        self.peeked: tuple[list[tuple[bytes, bytes]], bool] = ([], False)  # and its head
        self.sent_at = 0.0
        self.stage_request = request  # the client's request under the prefill's request id

    def _new_stage_id(self) -> None:
        """A new `X-Request-Id` for the next prefill and the decodes of its handle."""
        request = self.request
        headers = [(k, v) for k, v in request.headers if k != b"x-request-id"]
        headers.append((b"x-request-id", self.stages.request_id()))
        self.stage_request = request.with_headers(headers)

    def _head(self, target: Upstream, body: bytes) -> bytes:
        """A stage's head (asking, as every forwarded request does, for an answer as it is:
        stage one's is read here, and a compressed one could not be)."""
        return self.proxy.request_head(self.stage_request, target, body)

    # -- the stages' bodies ---------------------------------------------------------------------

    async def _members(self) -> Members:
        """The client's top-level members, naming the model as the workers serve it: decoded
        once (a large body's in the decoder process: with its fields, `Request.members`,
        else here, `members_of`)."""
        members = self.members
        if members is None:
            members = self.request.members
            if members is None:
                members = await members_of(self.request.body)
            if self.served != self.name:
                members = {**members, "model": msgspec.Raw(msgspec.json.encode(self.served))}
            self.members = members
        return members

    async def _body(self, members: Members) -> bytes:
        """The body of `members` (a large one encoded in the decoder's thread): the client's
        own when they are its members unchanged."""
        if members is self.members and self.source is not None:
            return self.source
        body = await encode_members(members)
        if members is self.members:
            self.source = body
        return body

    # -- attempts: a prefill, then the decode --------------------------------------------------

    def _attempt(self, failure: Exception | None) -> None:
        stages = self.model.stages if self.model is not None else None
        if stages is None or stages.pairsum != self.pairsum:
            self.prefilled_by = None  # (the pair serving changed: prefilled again in the new)
        if self.prefilled_by is not None or self.attempt > self.proxy.retries:
            super()._attempt(failure)  # a handle to send, or no attempt left (answers)
            return
        self.staging = asyncio.create_task(self._prefill(failure))

    async def _prefill(self, failure: Exception | None) -> None:
        """Stage one on prefill instances until one answers; then the decode attempt."""
        proxy = self.proxy
        served = self.model
        assert served is not None
        tried: list[Upstream] = []
        failed = 0  # failures that cost an attempt (a refused connect costs none)
        try:
            if self.prefill_body is None:
                self.prefill_body = await self._body(stage_one(await self._members()))
            while failed <= proxy.retries:
                stages = served.stages
                if stages is None:
                    break
                target = proxy.router.choose(stages.prefill, self.prompt, tried)
                if target is None:
                    break
                try:
                    handle = await self._stage_one(target)
                except UpstreamError as exc:
                    # (kept for its type and message; its traceback holds this frame, which
                    # holds it: a reference cycle for each failed prefill)
                    failure = exc.with_traceback(None)
                    self.stages.stats.failures["prefill"] += 1
                    if isinstance(exc, (AnswerTooLong, OutOfFiles)):  # (no instance's fault)
                        log.warning("prefill of a request for %s: %s", self.name, exc)
                        break
                    log.warning("prefill failed: %s; trying another prefill instance", exc)
                    target.inhibit(proxy.inhibit_seconds)
                    proxy.metrics.instances_inhibited.inc()
                    tried.append(target)
                    if not (isinstance(exc, ConnectRefused) and self._within_deadline()):
                        failed += 1
                    continue
                decode_body = await self._body(stage_two(await self._members(), handle))
                now = served.stages
                if now is None or now.pairsum != stages.pairsum:
                    failed += 1  # another pair serves now: its decodes cannot take this handle
                    failure = UpstreamError("the pair serving changed during the prefill")
                    continue
                self.decode_body, self.prefilled_by = decode_body, target
                self.pairsum = stages.pairsum
                break
        except ApiError as exc:  # the prefill refused the request: so would a decode
            if not self.done:
                self._finish(exc)
            return
        except msgspec.DecodeError as exc:  # (a member's name not UTF-8: JSON must be)
            if not self.done:
                self._finish(errors.bad_request(f"The request body is not valid JSON: {exc}"))
            return
        except Exception as exc:  # a fault of ours: this request fails, and only it
            log.exception("the prefill stage of a request for %s failed", self.name)
            if not self.done:
                self._finish(errors.upstream_failed(self.name, f"prefill stage: {exc}"))
            return
        finally:
            self.staging = None
        if self.done:
            return
        if self.prefilled_by is None:
            self.attempt = proxy.retries + 1  # no prefill answered: the answer is the failure
        super()._attempt(failure)

    async def _stage_one(self, target: Upstream) -> msgspec.Raw | None:
        """Send stage one to `target`; the `kv_transfer_params` it answered (None if none).
        `ApiError` when it refused the request (4xx), `UpstreamError` when it failed."""
        body = self.prefill_body
        assert body is not None
        self._new_stage_id()
        head = self._head(target, body)
        limits = (self.proxy.first_byte_timeout, self.proxy.upstream_idle_timeout)
        started = time.perf_counter()
        target.in_flight += 1
        try:
            try:
                status, answer = await self._exchange(
                    target, head, body, target.take_idle(), *limits
                )
            except StaleConnection:
                try:
                    status, answer = await self._exchange(target, head, body, None, *limits)
                except ConnectRefused as exc:  # (it died of the prefill: that costs an attempt)
                    what = f"{exc}, after it dropped a connection with the prefill"
                    raise UpstreamError(what) from None
        finally:
            target.in_flight -= 1
        if status >= 500:
            raise UpstreamError(f"prefill instance {target.address} answered {status}")
        if status >= 400:
            raise api_error(status, answer)
        self.stages.stats.prefill.observe(time.perf_counter() - started)
        return prefill_handle(answer, target.address)

    @staticmethod
    async def _exchange(
        target: Upstream,
        head: bytes,
        body: bytes,
        conn: UpstreamConnection | None,
        first_byte: float,
        idle: float,
    ) -> tuple[int, bytes]:
        """One request on `conn` (a new connection if None); the status and whole body, the
        head within `first_byte` seconds and no pause in it over `idle` (0: unbounded).
        `StaleConnection` when a pooled connection had been closed by the instance (a pooled
        connection that timed out was not: the instance has the request, it is not re-sent)."""
        reused = conn is not None
        if conn is None:
            conn = await target.connect()  # (within its own connect timeout)
        sink = PrefillSink(asyncio.get_running_loop())
        conn.send(head, body, sink)
        try:
            return await sink.answer(target.address, first_byte, idle)
        except UpstreamError as exc:
            conn.abort()
            if reused and not conn.answered and not isinstance(exc, UpstreamTimeout):
                raise StaleConnection() from None
            raise
        except BaseException:
            conn.abort()  # cancelled (the client left) or timed out: the prefill stops
            raise

    def _pick(self) -> Upstream | None:
        """A decode instance for the handle in hand (the body then carries it)."""
        served = self.model
        assert served is not None
        stages = served.stages
        if stages is None or self.prefilled_by is None:
            return None
        router, refused = self.stages.decode_router, self.refused
        target = router.choose(
            stages.decode, None, [*self.tried, *refused] if refused else self.tried
        )
        if target is None and refused:  # (its refusal was a prefill's fault: a new handle)
            target = router.choose(stages.decode, None, self.tried)
        if target is not None:
            self.body = self.decode_body
        return target

    def _models(self) -> tuple[str, ...]:
        return (self.served,)

    @property
    def origin(self) -> bytes:
        """The client's body naming the model as the decodes serve it (an alias's, encoded
        here if no stage needed it whole: a migration's, rare)."""
        source = self.source
        if source is None:
            source = self.source = rewrite_model(self.request.body, self.served, self.members)
        return source

    def _send(self, conn: UpstreamConnection) -> None:
        self.sent_at = time.perf_counter()
        self.peek = None
        super()._send(conn)

    def _attempt_failed(self, failure: Exception) -> None:
        """A decode failed before its first byte: the next decode gets a new prefill, unless
        this one never got the handle (a refused connect, a pooled connection found closed)."""
        conn = self.conn
        if not (conn is not None and conn.maybe_stale):  # (sent again: no failure yet)
            self.stages.stats.failures["decode"] += 1
            if not isinstance(failure, ConnectRefused):
                self.prefilled_by = None
        super()._attempt_failed(failure)

    def _may_retry(self) -> bool:
        served = self.model
        assert served is not None
        if self.attempt > self.proxy.retries or served.stages is None:
            return False
        tried = [*self.tried, self.target]
        decode = served.stages.decode.routable_sets
        return any(u not in tried for ws in decode for u in ws.routable)

    # -- the decode's answer -------------------------------------------------------------------

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], chunked: bool) -> bool:
        given = self.request.header(b"x-request-id")  # the client's id, never the stage's
        if given is not None:
            headers = [(k, given if k.lower() == b"x-request-id" else v) for k, v in headers]
        elif any(k.lower() == b"x-request-id" for k, _ in headers):  # (an engine's echo)
            headers = [(k, v) for k, v in headers if k.lower() != b"x-request-id"]
        if status == 400 and not self.started:  # a refused handle? read it whole first
            self.head_seen = True
            self.peek, self.peeked = [], (headers, chunked)
            return True
        return super().on_head(status, headers, chunked)

    def on_body(self, data: bytes) -> None:
        peek = self.peek
        if peek is not None:  # (nothing of it reached the migration or the figures yet)
            peek.append(data)
            if sum(map(len, peek)) > MAX_PEEK:  # too long for a refusal: relayed
                self._relay_peeked()
            return
        if not self.body_seen:
            self.stages.stats.decode_ttft.observe(time.perf_counter() - self.sent_at)
        super().on_body(data)

    def _relay_peeked(self) -> None:
        peek, self.peek = self.peek or [], None
        headers, chunked = self.peeked
        if super().on_head(400, headers, chunked):
            self.on_body(b"".join(peek))

    def flush(self, final: bool = False) -> None:
        if self.peek is not None and not final:
            self.progress = True
            return  # held until the whole refusal is read
        super().flush(final)

    def on_complete(self) -> None:
        if self.peek is not None:
            if refuses_handle(b"".join(self.peek)):
                self.peek = None
                self._handle_refused()
                return
            self._relay_peeked()
        super().on_complete()

    def _handle_refused(self) -> None:
        """The decode could not fetch the prefill's blocks: that prefill failed; again with
        a new one (the decode is not inhibited), on another decode when there is one: a
        decode that refuses every handle is idle, so least-loaded would pick it again. It
        is taken again when no other is left (the refusal was the prefill's fault: a prefill
        and a decode died together, and the other decode is the dead one)."""
        self.out = []
        self.body_seen = self.whole = False  # (nothing reached the client: held again)
        decode = self.target
        if decode is not None:  # (another decode goes first; it stays a last resort)
            self.refused.append(decode)
        self._end_attempt()
        prefill, self.prefilled_by = self.prefilled_by, None
        self.stages.stats.failures["prefill"] += 1
        failure = UpstreamError("the decode instance could not fetch the prefilled KV blocks")
        if prefill is not None:
            log.warning("%s from %s; prefilling again", failure, prefill.address)
            prefill.inhibit(self.proxy.inhibit_seconds)
            self.proxy.metrics.instances_inhibited.inc()
        self._attempt(failure)

    # -- the end -------------------------------------------------------------------------------

    def cancel(self) -> None:
        """The client left: a prefill in progress is cancelled, and no decode starts."""
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.cancel()
        super().cancel()


class AnswerTooLong(UpstreamError):
    """A prefill's answer over `MAX_PREFILL_ANSWER`: what the request asked for (`n` choices,
    logprobs), which every prefill would answer alike. Only the request fails (a 502): no
    instance is inhibited for it, and no other prefill is asked."""


class StaleConnection(UpstreamError):
    """A pooled connection the instance had closed: nothing was sent, try a new one."""
