"""`Forward`: one request on its way to a worker and its answer on the way back.

A `Forward` carries one request from the pick of an instance to the end of its answer (the
proxy decoded its fields and started it), driven by callbacks: from the client's packet to the
worker's answer it creates no task and no future (only opening a new upstream connection
awaits, and a policy's work on the prompt off the event loop, `Router.prepare`). Per request:
one small JSON decode, one routing pick, one write each way, a few counter increments.

Failure handling: a connect error, a transport error or a 5xx before the first response byte
reached the client marks the instance down for `inhibit_seconds` and tries another (up to
`retries` more attempts). So does an instance that sends no complete response head within
`first_byte_timeout` of the request (it hangs, is stuck, or stalls mid-head); when no
instance answers in time the client gets 504. Once the head is in, the gap between packets
of the body is bounded by `upstream_idle_timeout`. Both are enforced by one sweep for all
requests (`deadlines.py`, which says how late they may fire), not a timer per request. A
refused or reset connect costs no attempt: dead instances are skipped, each inhibited, until
one answers or none is left (within the first-byte timeout counted from the request's
arrival). A failure before the first byte is retried even if the worker had started
generating: there is no idempotency key, and a completion has no side effect but the compute
spent. After the first byte, a failure (an idle timeout included) moves a stream that may
migrate to another instance (`migration`), else ends an SSE stream with an error event, and
any other response by closing the client connection. A stream's client gets whole events
only (the start of one is held until its end, and dropped at a break: `sse.Unfinished`), so
its error event never ends half an event. A client that disconnects cancels the handler,
which drops the upstream connection so the worker stops generating.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from mypy_extensions import mypyc_attr

from shoal.frontend.http import errors
from shoal.frontend.http.exchange import ConnectRefused, OutOfFiles, UpstreamError, UpstreamTimeout
from shoal.frontend.http.request import ClientConnection, Request, status_line
from shoal.frontend.http.upstream import Upstream, UpstreamConnection
from shoal.frontend.proxy import migration, sse
from shoal.frontend.proxy.deadlines import Deadlines
from shoal.frontend.proxy.fields import Fields, prompt_hint
from shoal.frontend.proxy.headers import relay_response_headers
from shoal.frontend.proxy.migration import ContinuationRefused, Migration, StreamCutShort
from shoal.frontend.registry.metrics import FrontendMetrics, ModelStats
from shoal.frontend.registry.registry import Model
from shoal.frontend.registry.router import Router
from shoal.openai import ApiError

log = logging.getLogger(__name__)


class Gateway(Protocol):
    """What a `Forward` reads of the `Proxy` that started it."""

    router: Router
    metrics: FrontendMetrics
    retries: int
    deadlines: Deadlines | None  # None: neither timeout is set
    migration_limit: int

    # (properties: a compiled build reads a protocol's float attributes wrongly, mypyc 1.20)
    @property
    def inhibit_seconds(self) -> float: ...
    @property
    def first_byte_timeout(self) -> float: ...
    @property
    def upstream_idle_timeout(self) -> float: ...

    def request_head(self, request: Request, target: Upstream, body: bytes) -> bytes: ...


@mypyc_attr(native_class=False)
class FirstByteTimeout(UpstreamTimeout):
    """An instance sent no complete response head within the first-byte timeout."""


@mypyc_attr(native_class=False)
class UpstreamIdleTimeout(UpstreamTimeout):
    """An instance sent nothing for the idle timeout in the middle of a response body."""

    reason = "idle_timeout"  # (its label in the migration metric)


@mypyc_attr(allow_interpreted_subclasses=True)  # (disagg.TwoStageForward)
class Forward:
    """One request on its way: pick an instance, send, stream the answer back, retry early failures.

    It is the `ResponseSink` of the upstream connection carrying the current attempt, and the
    work the client connection waits on (`produce_later`), cancelled if the client goes away.
    It touches the client only through `ClientConnection`. A packet from the worker is written
    once (`on_packet`). `started` turns True when the first byte reached the client: from then
    on a failure cannot be retried, and a stream ends with an SSE error event instead.
    """

    __slots__ = (
        "attempt",
        "body",
        "body_seen",
        "chunked",
        "client",
        "conn",
        "connecting",
        "done",
        "fields",
        "head_seen",
        "held",
        "last_read",
        "migration",
        "model",
        "name",
        "out",
        "progress",
        "prompt",
        "proxy",
        "request",
        "since",
        "started",
        "stats",
        "status",
        "stream",
        "tail",
        "target",
        "tried",
        "whole",
    )

    def __init__(
        self,
        proxy: Gateway,
        request: Request,
        client: ClientConnection,
        model: Model | None,
        fields: Fields,
        stats: ModelStats,
    ) -> None:
        self.proxy = proxy
        self.request = request
        self.client = client
        self.body = request.body  # what is sent: the client's body, unless a route rewrote it
        self.model = model  # None for a virtual model (`VirtualForward`)
        self.name = fields.model or ""
        self.fields = fields
        self.stats = stats
        self.stream = bool(fields.stream)
        router = proxy.router
        self.prompt = prompt_hint(fields, router.prompt_of) if router.needs_prompt else None
        self.tried: list[Upstream] = []
        self.attempt = 0
        self.target: Upstream | None = None
        self.conn: UpstreamConnection | None = None
        self.connecting: asyncio.Task[None] | None = None
        # Deadlines (`check_deadline`, perf_counter seconds): when the attempt was sent, and
        # when the last packet of its response came (dated by the sweep that saw `progress`).
        self.since = 0.0
        self.last_read = 0.0
        self.progress = False  # a packet of the response came since the last sweep
        self.out: list[bytes] = []
        self.status = 0
        self.chunked = False
        # A stream the migration does not read is checked packet by packet (`whole`): the
        # start of an event whose end has not come is `held` from the client.
        self.whole = False
        self.held: sse.Unfinished | None = None
        self.tail = b""  # (the last piece of such a stream relayed: `_break_off`)
        self.head_seen = False
        self.body_seen = False
        self.started = False
        self.done = False
        self.migration: Migration | None = None  # a stream that may move (migration.py)

    def start(self) -> None:
        self.stats.in_flight += 1
        if self.stream and self.model is not None:
            self.migration = migration.prepare(self, self.model, self.proxy.migration_limit)
        self.client.produce_later(self)
        ready = None if self.prompt is None else self._prepare()
        if ready is None:
            self._attempt(None)
        else:  # the router works on the prompt off the event loop: pick when it is done
            ready.add_done_callback(self._prepared)

    def _prepare(self) -> asyncio.Future[None] | None:
        """The router's work on the prompt before the first pick (`Router.prepare`)."""
        if self.prompt is None:
            return None
        try:
            return self.proxy.router.prepare(self.prompt, self._models())
        except Exception:  # routing goes on without it
            log.exception("preparing the prompt of a %s request failed", self.name)
            return None

    def _prepared(self, _: asyncio.Future[None]) -> None:
        if not self.done:
            self._attempt(None)

    def _models(self) -> tuple[str, ...]:
        """The models this request may be sent to."""
        return (self.name,)

    # -- attempts ----------------------------------------------------------------------------

    def _attempt(self, failure: Exception | None) -> None:
        """Send to the next instance; after the last one, answer with the failure. Whatever
        raises on the way ends the request with a 500 (`_broken`), never past it."""
        try:
            self._next_attempt(failure)
        except Exception:
            self._broken()

    def _next_attempt(self, failure: Exception | None) -> None:
        target = None
        if self.attempt <= self.proxy.retries:
            try:
                target = self._pick()
            except Exception:  # a router's bug fails this request, never the gauges
                log.exception("routing a %s request failed", self.name)
                self._finish(errors.internal_error())
                return
        if target is None:
            name = self.name
            if failure is None:
                error = errors.no_ready_instance(name)
            elif isinstance(failure, UpstreamTimeout):  # (the first-byte or the idle wait)
                error = errors.upstream_timeout(name, str(failure))
            elif isinstance(failure, OutOfFiles):
                error = errors.out_of_files(str(failure))
            elif isinstance(failure, ApiError):  # an answer the failure carries (routed.py)
                error = failure
            else:
                error = errors.upstream_failed(name, str(failure))
            self._finish(error)
            return
        if self.tried:
            self.stats.retries += 1
        self.attempt += 1
        self.launch(target)

    @property
    def origin(self) -> bytes:
        """The body a continuation of this stream is made from (migration.py): the client's,
        naming the model as the instances serve it."""
        return self.request.body

    def _head(self, target: Upstream, body: bytes) -> bytes:
        """The request head sent to `target` with `body`: the client's headers, as a rule."""
        return self.proxy.request_head(self.request, target, body)

    def launch(self, target: Upstream) -> None:
        """Send to `target`, on an idle connection or a new one."""
        self.target = target
        target.in_flight += 1
        conn = target.take_idle()
        if conn is None:
            self.connecting = asyncio.create_task(self._connect(target))
        else:
            self._send(conn)

    def _pick(self) -> Upstream | None:
        """The instance of the next attempt (see `Router.choose`)."""
        model = self.model
        assert model is not None
        return self.proxy.router.choose(model, self.prompt, self.tried)

    async def _connect(self, target: Upstream, resent: bool = False) -> None:
        """The only await of the request path: opening a connection when none is idle, or
        (`resent`) after a pooled one failed unanswered: refused then, the instance died of
        the request (an attempt spent). The client may leave as the connect completes, and
        the connection may still arrive despite the cancellation: it goes to the pool."""
        try:
            conn = await target.connect()
        except Exception as exc:
            self.connecting = None
            if resent and isinstance(exc, ConnectRefused):
                exc = UpstreamError(f"{exc}, after it dropped a connection with the request")
            if not self.done:
                self._attempt_failed(exc)
            return
        self.connecting = None
        if self.done or self.target is not target:
            target.release(conn)
            return
        try:
            self._send(conn)
        except Exception:
            self._broken()

    def _send(self, conn: UpstreamConnection) -> None:
        assert self.target is not None
        self.conn = conn
        self.out = []
        self.head_seen = False
        if not self.started:  # (a migrated stream's continuation keeps the client's framing)
            self.chunked = False
        self.client.follow(conn)
        body = self.body
        conn.send(self._head(self.target, body), body, self)
        if (deadlines := self.proxy.deadlines) is not None:
            self.since = self.last_read = time.perf_counter()
            deadlines.watch(self)

    def check_deadline(self, now: float) -> None:
        """The first-byte timeout until the head is complete, then the idle timeout between
        packets (the sweep's call): a paused connection (a slow client) starts the wait again."""
        conn = self.conn
        if self.done or conn is None:
            self._disarm()
            return
        proxy = self.proxy
        if conn.paused:
            self.since = self.last_read = now
            self.progress = False
        elif not self.head_seen and (proxy.first_byte_timeout > 0 or not conn.answered):
            seconds = proxy.first_byte_timeout  # (0, once the head began: the idle timeout's)
            if seconds > 0 and now - self.since > seconds:
                assert self.target is not None
                self.conn = None  # (not mistaken for an idle connection the worker had closed)
                conn.abort()
                address = self.target.address
                self._attempt_failed(
                    FirstByteTimeout(
                        f"instance {address} sent no complete response head within {seconds:g}s"
                    )
                )
        elif self.progress:
            self.progress = False
            self.last_read = now
        elif (seconds := proxy.upstream_idle_timeout) > 0 and now - self.last_read > seconds:
            assert self.target is not None
            self.conn = None
            conn.abort()
            self.on_failure(
                UpstreamIdleTimeout(f"instance {self.target.address} sent nothing for {seconds:g}s")
            )

    def _disarm(self) -> None:
        if (deadlines := self.proxy.deadlines) is not None:
            deadlines.unwatch(self)

    def _attempt_failed(self, failure: Exception) -> None:
        """The attempt failed before any byte reached the client: try elsewhere."""
        self._disarm()
        target, conn = self.target, self.conn
        assert target is not None
        self.conn = None
        self.client.follow(None)
        if conn is not None and conn.maybe_stale:  # (closed while idle? sent again, once)
            self.connecting = asyncio.create_task(self._connect(target, True))
            return
        target.in_flight -= 1
        self.target = None
        if self.started:  # a migrated stream's continuation failed before its first event
            return self._failed_after_start(failure, target)
        if isinstance(failure, OutOfFiles):  # (the gateway's own limit: no instance to blame,
            log.error("%s: out of file descriptors", failure)  # and none would fare better)
            return self._finish(errors.out_of_files(str(failure)))
        log.warning("%s; trying another instance", failure)
        target.inhibit(self.proxy.inhibit_seconds)
        self.proxy.metrics.instances_inhibited.inc()
        self.tried.append(target)
        if isinstance(failure, ConnectRefused) and self._within_deadline():
            self.attempt -= 1  # a dead instance cost nothing: the retry budget is for slow ones
        self._attempt(failure)

    def _within_deadline(self) -> bool:
        """Whether the request may still try instances (the first-byte timeout since it came)."""
        limit = self.proxy.first_byte_timeout
        return not limit or time.perf_counter() - self.request.received < limit

    def _may_retry(self) -> bool:
        """Whether a 5xx is worth another attempt: attempts left, and an instance not tried."""
        if self.attempt > self.proxy.retries:
            return False
        tried = [*self.tried, self.target]
        model = self.model
        assert model is not None
        return any(u not in tried for ws in model.routable_sets for u in ws.routable)

    # -- ResponseSink ------------------------------------------------------------------------

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], chunked: bool) -> bool:
        self.head_seen = True  # (`flush`, right after this packet is parsed, sets `progress`)
        if self.started:  # a migrated stream's continuation: the client has its head
            if status == 200:
                return True
            assert self.target is not None
            what = f"instance {self.target.address} answered {status} to a continuation"
            self._attempt_failed(
                UpstreamError(what) if status >= 500 else ContinuationRefused(what)
            )
            return False
        if status >= 500 and self._may_retry():
            assert self.target is not None
            self._attempt_failed(UpstreamError(f"instance {self.target.address} answered {status}"))
            return False
        if not chunked and self.migration is not None:
            self.migration.sized()  # (the client is told the length: nothing is spliced in)
        client = self.client
        self.status = status
        parts = [status_line(status)]
        relay_response_headers(headers, parts)
        if chunked:
            if self.request.http11:
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                client.close_after_response()  # HTTP/1.0: the body ends with the connection
        if not client.keep_alive:
            parts.append(b"connection: close\r\n")
        assert self.target is not None
        parts += (b"x-shoal-instance: ", self.target.label, b"\r\n\r\n")
        self.out.append(b"".join(parts))
        return True

    def on_packet(self, bodies: list[bytes]) -> None:
        """A packet of the answer: its pieces (`on_body` each), then `flush`. A stream's usual
        packet, one piece after the first, goes the short way (`out` is empty then)."""
        if len(bodies) != 1 or not self.body_seen:
            for data in bodies:
                self.on_body(data)
            self.flush()
            return
        self.progress = True
        data = bodies[0]
        if self.whole and data[-1] == 10:  # (as in `on_body`)
            self.tail = data
        elif (migration := self.migration) is not None and migration.parsing:
            data = migration.feed(data)  # (as in `on_body`)
            if data and not migration.parsing:
                data = self._whole_events(data)
            if not data:
                return
        elif (self.whole or self.held is not None) and not (data := self._whole_events(data)):
            return
        if self.client.write_if_open(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data):
            self.started = True

    def on_body(self, data: bytes) -> None:
        if self.whole and data[-1] == 10:  # (a stream the migration does not read: a newline
            self.tail = data  # ends whole lines, no more work than that; never empty: a
        else:  # transport's read, and a parser error if it were)
            if not self.body_seen:
                self.body_seen = True
                if self.stream:
                    self.stats.ttft.observe(time.perf_counter() - self.request.received)
                    migration = self.migration
                    # (a sized answer cut short is closed: it never ends with an error event)
                    self.whole = self.chunked and (migration is None or not migration.parsing)
            migration = self.migration
            if migration is not None and migration.parsing:  # (whole events out)
                data = migration.feed(data)
                if data and not migration.parsing:  # (it gave up: this packet as it came)
                    data = self._whole_events(data)
            elif self.whole or self.held is not None:
                data = self._whole_events(data)
            if not data:
                return
        if self.chunked:
            self.out.append(b"%x\r\n%s\r\n" % (len(data), data))  # (one copy, not three pieces)
        else:
            self.out.append(data)

    def _whole_events(self, data: bytes) -> bytes:
        """What of `data` ends whole events, for the client now; the rest is `held` (`whole`
        off until its event ends)."""
        held = self.held or sse.Unfinished()
        data = held.take(data, self.tail[-2:])
        self.held = held if held.size else None
        self.whole = self.held is None
        if data:
            self.tail = data
        return data

    def flush(self, final: bool = False) -> None:
        """Write what a packet produced. The response head waits for the first body byte (or
        the end): a worker dying before its first token is retried elsewhere, nothing sent."""
        self.progress = True
        out = self.out
        if not out or not (self.body_seen or final):
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        if self.client.write_if_open(data):
            self.started = True

    def on_complete(self) -> None:
        if self.migration is not None and not self.migration.complete():
            assert self.target is not None
            self.on_failure(
                StreamCutShort(f"instance {self.target.address} ended the stream early")
            )
            return
        if self.held is not None and (rest := self.held.release()):  # (as they came)
            self.out.append(b"%x\r\n%s\r\n" % (len(rest), rest) if self.chunked else rest)
        if self.migration is not None and (rest := self.migration.rest()):
            self.out.append(b"%x\r\n%s\r\n" % (len(rest), rest) if self.chunked else rest)
        if self.chunked:
            self.out.append(b"0\r\n\r\n")
        self.flush(final=True)
        self._end_attempt()
        self._finish(None)

    def end(self, events: bytes) -> None:
        """End a failed stream with nothing left to generate with `events` (`Migration`)."""
        self.out.append(
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events) if self.chunked else events
        )
        self.flush(final=True)
        self._finish(None)

    def on_failure(self, exc: Exception) -> None:
        if not self.started:
            self._attempt_failed(exc)
            return
        self.flush()
        target = self.target
        self._end_attempt()
        self._failed_after_start(exc, target)

    def _failed_after_start(self, exc: Exception, target: Upstream | None) -> None:
        """The response failed after its first byte reached the client: a stream that may
        migrate goes on elsewhere (`Migration.resume`), any other ends (nothing held sent)."""
        self.held = None
        try:  # (not out of files: each continuation's instance was blamed, inhibited in turn)
            migration = None if isinstance(exc, OutOfFiles) else self.migration
            if migration is not None and migration.resume(exc, target):
                return
        except Exception:
            self._broken()
            return
        self._break_off(exc)
        self._finish(None)

    # -- the end -----------------------------------------------------------------------------

    def cancel(self) -> None:
        """The client went away: drop the upstream connection, so the worker stops too."""
        if self.done:
            return
        if self.connecting is not None:
            # (dropped: the cancelled task keeps its `CancelledError`, whose traceback holds
            # this forward, a reference cycle until the garbage collector's next pass)
            self.connecting.cancel()
            self.connecting = None
        if self.conn is not None:
            self.conn.abort()
        self._end_attempt()
        self.status = 499
        self._finish(None)

    def _broken(self) -> None:
        """A bug on the request path (in an `except`): logged, the attempt dropped, the client
        answered 500 (or cut off), the request counted and off the in-flight gauge as any."""
        log.exception("request for %s failed in the gateway", self.name)
        if self.done:
            return
        if self.connecting is not None:
            self.connecting.cancel()
            self.connecting = None
        if self.conn is not None:
            self.conn.abort()
        self._end_attempt()
        if self.started:
            self.client.close_after_response()
        self._finish(errors.internal_error())

    def _end_attempt(self) -> None:
        self._disarm()
        if self.target is not None:
            self.target.in_flight -= 1
            self.target = None
        self.conn = None
        self.client.follow(None)

    def _break_off(self, failure: Exception) -> None:
        """A response failed after its first byte reached the client. A stream ends with the
        gateway's error event (`sse.break_event`: after whole lines, the event is ended first),
        unless the client has its `[DONE]`: then it ends there (nothing may follow that)."""
        log.warning("response for %s broke off: %s", self.name, failure)
        if self.chunked and self.stream and self.client.writable:
            done = self.migration is not None and self.migration.done  # (else `tail` says)
            end = b"" if done else sse.break_event(failure, self.tail)
            self.client.write((b"%x\r\n%s\r\n" % (len(end), end) if end else b"") + b"0\r\n\r\n")
        else:
            self.client.close_after_response()  # the body is cut short: only closing tells

    def _finish(self, error: ApiError | None) -> None:
        """Count the request and end its response, once (whichever path gets here first)."""
        if self.done:
            return
        self.done = True
        stats = self.stats
        stats.in_flight -= 1
        stats.count(error.status if error is not None else self.status)
        stats.duration.observe(time.perf_counter() - self.request.received)
        self.client.finish(error)
        # A migration and its forward refer to each other: else the pair and the stream's last
        # packet waited for the garbage collector (170 KB at c1: ~50 page faults of the heap).
        self.migration = None
