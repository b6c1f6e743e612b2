"""Streams that survive their instance: a stream whose instance fails after its first token
goes on at another instance of the same worker set, which continues the text so far.

A `Migration` rides along a `Forward` (forward.py) of a streamed chat or text completion
when the model may migrate (`--migration-limit`, or the card's `runtime_config`
`migration_limit`) and has another instance. Only then are the stream's SSE events parsed
(`feed`): whole events pass to the client (a partial one waits for its end: no half event
when the instance dies), and the text, the tokens (the usage's count when chunks carry one,
`continuous_usage_stats`; else one a content chunk, a lower bound), the stream's `id` and
`created` are kept, read in batches (`catch_up`). Others keep the byte pass-through.

When the instance fails (reset, an end before `[DONE]` and before the finish reason, the
idle timeout), `resume` re-issues the request to another instance of the set, never one
tainted or tried (inhibited: when no other is left): chat with the text as a final assistant message,
`continue_final_message: true` and `add_generation_prompt: false` (vLLM's and SGLang's);
completions with the text appended to the prompt; `max_tokens`/`max_completion_tokens`
less the tokens received. The continuation's events are rewritten into the client's stream: its `id` and `created`,
the role chunk dropped, and the usage chunk counting every token the client received
(the continuation's prompt holds the carried tokens: they move back to the completion).
Text continuation: the next instance re-tokenizes the text, so a real engine may split it
into other tokens than it was generated as.

Not migrated (the stream ends with the error event as before, and
`shoal_frontend_migrations_total{outcome="refused"}` says why): `n` > 1, `logprobs`,
`echo`, a prompt that is not one string, tool calls in the stream, a card that says so
(`migration_limit: 0`), no other instance, the limit reached, more text than `MAX_CARRIED`,
a body framed by its `Content-Length` (the client has the length: `sized`), text that ends
with the start of a stop string (`continuation.halt`). A stream that failed with no tokens
left to generate is ended by the gateway (`continuation.ending`), not continued."""

from __future__ import annotations

import io
import logging
import time
from typing import Any, Protocol

import msgspec

from shoal.frontend.http.exchange import UpstreamError
from shoal.frontend.http.request import Request
from shoal.frontend.http.upstream import Upstream
from shoal.frontend.proxy import continuation, sse
from shoal.frontend.registry.metrics import FrontendMetrics
from shoal.frontend.registry.registry import Model, WorkerSet
from shoal.frontend.registry.router import Router, last_resort

log = logging.getLogger(__name__)


class _Proxy(Protocol):
    @property
    def router(self) -> Router: ...
    @property
    def metrics(self) -> FrontendMetrics: ...
    @property
    def retries(self) -> int: ...
    @property
    def inhibit_seconds(self) -> float: ...


class Forward(Protocol):
    """What a migration sees of the request it rides along (`forward.Forward`)."""

    request: Request
    body: bytes
    name: str
    status: int
    tried: list[Upstream]

    @property
    def proxy(self) -> _Proxy: ...
    @property
    def model(self) -> Model | None: ...
    @property
    def prompt(self) -> str | None: ...
    @property
    def target(self) -> Upstream | None: ...
    @property
    def origin(self) -> bytes:
        """The body a continuation is made from."""
        ...

    def launch(self, target: Upstream) -> None:
        """Send `body` to `target`."""
        ...

    def end(self, events: bytes) -> None:
        """End the client's stream with `events` (no instance is asked)."""
        ...


CHAT_PATH = b"/v1/chat/completions"
COMPLETIONS_PATH = b"/v1/completions"
MAX_CARRIED = 1 << 20
"""Characters of generated text a stream keeps for a continuation; past them it cannot migrate."""
MAX_EVENT = 1 << 20
"""Bytes of one SSE event held until its end; a longer one ends parsing (no migration)."""
READ_BATCH = 64 * 1024
"""Bytes of whole events passed to the client before they are read (`catch_up`): in one
decode, not one per event; what a migration needs is read before it is needed. A stream
that ends with its `[DONE]` before that is never read (`complete`): most never fail. (The
events are kept as they came, references to the pieces relayed: at most this per stream,
as much as a client's send buffer holds.)"""
CARD_KEY = "migration_limit"
"""The card's `runtime_config` key: its own limit (0: its model cannot continue text)."""


class StreamCutShort(UpstreamError):
    """The instance ended the response before the stream's `data: [DONE]`."""

    reason = "eof"  # (the failure's label in the migration metric; else "lost")


class ContinuationRefused(UpstreamError):
    """The instance answered the continuation with an error status (it cannot continue)."""


_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def limit_of(model: Model, default: int) -> int:
    """The migration limit of `model`: `default` (the frontend's), unless its card's
    `runtime_config` sets its own; 0 from either turns migration off. A disaggregated
    model's streams come from its decode stage: the decode card says."""
    if default <= 0:
        return 0
    sets = model.routable_sets
    if model.stages is not None:  # (its requests are disaggregated: the decode card first)
        sets = model.stages.decode.routable_sets + sets
    for ws in sets:
        for member in ws.members.values():
            value = member.card.runtime_config.get(CARD_KEY)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
            return default
    return default


def prepare(forward: Forward, model: Model, default_limit: int) -> Migration | None:
    """The migration of a streamed request, or None when it is not a chat or completion.
    A stream that cannot migrate gets one that only says why (no parsing). Never raises:
    a request goes on without migration rather than fail for it."""
    try:
        return _prepare(forward, model, default_limit)
    except Exception:
        log.exception("deciding whether a %s stream may migrate failed", forward.name)
        return None


def _prepare(forward: Forward, model: Model, default_limit: int) -> Migration | None:
    path = forward.request.path
    if path == CHAT_PATH:
        chat = True
    elif path == COMPLETIONS_PATH:
        chat = False
    else:
        return None
    limit = limit_of(model, default_limit)
    refused: str | None = None
    if limit <= 0:
        refused = "disabled" if default_limit <= 0 else "card"
    elif model.live_instances < 2:
        refused = "no_instance"
    # (the body is read for what it asks at the first failure, `_read_body`: not a second
    # decode of every stream's body, most of which never fail)
    return Migration(forward, chat, limit, refused)


def _odd(delta: sse.Delta) -> str:
    """Why a delta with more than text cannot be continued: a tool call is not carried, nor
    reasoning (a continuation would start its message again, or think again from nothing)."""
    return "tool_calls" if delta.tool_calls or delta.function_call else "reasoning"


class Migration:
    """The state of one stream that may move to another instance (see the module doc)."""

    __slots__ = ("began", "carried", "chat", "created", "delivered", "done", "failed_at",
        "finished", "forward", "id", "limit", "members", "migrations", "model", "opened",
        "parsing", "pending", "pending_size", "reason", "refused", "resuming", "retries",
        "size", "text", "tokens", "unread", "unread_size", "usage", "ws")  # fmt: skip

    def __init__(
        self,
        forward: Forward,
        chat: bool,
        limit: int,
        refused: str | None,
        members: dict[str, msgspec.Raw] | None = None,
    ) -> None:
        self.forward = forward
        self.members = members  # the members of the request's body (read once, as they came)
        self.chat = chat
        self.limit = limit
        self.refused = refused  # why the stream cannot migrate (now), or None
        self.parsing = refused is None
        # The start of an event whose end has not come yet, as it came (joined only when
        # the end comes: an event dripped in small reads is not copied at each one).
        self.pending: list[bytes] = []
        self.pending_size = 0
        self.began = False  # a whole `data:` event went to the client
        self.unread: list[bytes] = []  # whole events the client has, not read yet
        self.unread_size = 0
        self.text = io.StringIO()  # (no string object per chunk: a chunk may be one character)
        self.size = 0
        self.tokens = 0  # content chunks the client received: the tokens generated
        self.carried = 0  # of those, the ones before the current attempt's continuation
        self.id: Any = None
        self.created: Any = None
        self.model: Any = None  # (the stream's first `model`, and the first attempt's `usage`)
        self.usage: Any = None
        self.finished = False  # a finish reason was seen
        self.done = False  # `data: [DONE]` was seen
        self.ws: WorkerSet | None = None
        self.migrations = 0
        self.retries = 0
        self.resuming = False  # the current attempt is a continuation
        self.delivered = False  # the current attempt sent a whole event
        self.reason = ""  # why the first migration happened (for the success count)
        self.opened = False  # the client has the stream's first event (chat: its role chunk)
        self.failed_at = 0.0  # when the stream last failed (perf_counter), until it went on

    # -- the stream ------------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """What of `data` (the response body as it comes) goes to the client now: whole
        events, rewritten when the attempt is a continuation."""
        if not self.parsing or not data:
            return data
        if data[-2:] == b"\n\n" and self.began and not self.pending and not self.resuming:
            self.unread.append(data)  # (the common packet: whole events, kept to read later)
            self.unread_size += len(data)
            if self.unread_size >= READ_BATCH:
                self.catch_up()
            return data
        if not self.began and not self.resuming and not self.pending:  # the first packet
            if self.forward.status != 200 or not sse.sse_start(data):
                return self._give_up(data, "not_sse")  # an error, or not a stream at all
            self.ws = self._find_set()
        pending = self.pending
        if pending:
            if b"\n\n" not in data and not (data[:1] == b"\n" and pending[-1][-1:] == b"\n"):
                return self._hold(data)  # the event goes on
            data = b"".join(pending) + data
            self.pending, self.pending_size = [], 0
        end = data.rfind(b"\n\n")
        if end < 0:
            return self._hold(data)
        rest = data[end + 2 :]
        if len(rest) > MAX_EVENT:
            return self._give_up(data, "framing")
        if rest:
            self.pending, self.pending_size = [rest], len(rest)
        complete = data[: end + 2]
        if not self.resuming:  # (read later, many at once: `catch_up`)
            if not self.began:
                self.began = b"data:" in complete
            self.unread.append(complete)
            self.unread_size += len(complete)
            if self.unread_size >= READ_BATCH:
                self.catch_up()
            self.delivered = True
            return complete
        out = b"".join([self._rewrite(event) for event in complete.split(b"\n\n")[:-1]])
        self.delivered = True
        if out and self.failed_at:
            elapsed = time.perf_counter() - self.failed_at
            self.forward.proxy.metrics.migration_splice.observe(elapsed)
            self.failed_at = 0.0
        return out

    def sized(self) -> None:  # (the response has a `Content-Length`, which the client gets)
        self._give_up(b"", "framing")

    def _hold(self, data: bytes) -> bytes:
        """Keep `data`, a part of an event whose end has not come (nothing for the client
        now); an event over `MAX_EVENT` or framed with CR (CRLF, or a bare CR: no JSON holds
        a raw CR) ends parsing."""
        pending = self.pending
        pending.append(data)
        self.pending_size += len(data)
        if b"\r" in data or self.pending_size > MAX_EVENT:
            return self._give_up(b"".join(pending), "framing")
        return b""

    def _give_up(self, data: bytes, reason: str) -> bytes:
        """Events the gateway cannot read: pass the rest as it comes, migrate no more."""
        self.parsing = False
        self.refused = self.refused or reason
        self.pending, self.pending_size = [], 0
        return data

    def catch_up(self) -> None:
        """Read the whole events passed to the client since the last time. Events that are
        each one `data:` line are read as one JSON array (their payloads joined by commas,
        one decode for all); else, or when one of them is no chunk, one by one."""
        unread = self.unread
        if not unread:
            return
        data = unread[0] if len(unread) == 1 else b"".join(unread)
        self.unread, self.unread_size = [], 0
        if sse.ends_done(data):
            self.done = True
            data = data[: -len(sse.DONE)]
        if not data:
            return
        if data.startswith(b"data:"):
            payloads = data[5:-2]
            joined = payloads.replace(b"\n\ndata:", b",")
            try:
                chunks = sse.decode_chunks(b"[%s]" % joined)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                chunks = None  # (an event that is not one `data:` line, or no chunk)
            # One chunk per `data:` event (each replacement took 6 bytes), every event but the
            # last ending with its object's `}`: a cut event spliced to the next is no chunk.
            # (Payloads that are no JSON text each may still join into as many chunks: that
            # changes only how that worker's own stream is continued.)
            between = (len(payloads) - len(joined)) // 6
            if (
                chunks is not None
                and len(chunks) == between + 1
                and payloads.count(b"}\n\ndata:") == between
            ):
                self._keep_all(chunks)
                self.opened = True
                return
        for event in data.split(b"\n\n")[:-1]:
            if self._read(event) is not None:
                self.opened = True  # (a chunk, not a comment: the client's stream began)

    def _keep_all(self, chunks: list[sse.Chunk]) -> None:
        """`_keep` of each of `chunks`, a comprehension per step rather than Python per chunk."""
        if self.id is None:
            for chunk in chunks:
                if chunk.id is not None:
                    self.id, self.created, self.model = chunk.id, chunk.created, chunk.model
                    break
        if usages := [chunk.usage for chunk in chunks if chunk.usage is not None]:
            self.usage = usages[-1]
        choices = [choice for chunk in chunks if chunk.choices for choice in chunk.choices]
        deltas = [c.delta for c in choices if c.delta is not None]
        pieces = [d.content for d in deltas] if len(deltas) == len(choices) else None
        if pieces is None:  # (a completion's choices: their text)
            pieces = [c.text if c.delta is None else c.delta.content for c in choices]
        odd = [d for d in deltas if d.tool_calls or d.function_call or d.reasoning_content
               or d.reasoning]  # fmt: skip
        if odd:
            self.refused = self.refused or _odd(odd[0])
        if [c for c in choices if c.finish_reason is not None]:
            self.finished = True
        texts = [p for p in pieces if p and isinstance(p, str)]
        counted = continuation.tokens_of(chunks, self.tokens, self.carried) if usages else None
        self.tokens = self.tokens + len(texts) if counted is None else counted
        text = "".join(texts)
        if self.size + len(text) > MAX_CARRIED:
            self.refused = self.refused or "too_long"  # (it cannot migrate: the text is moot)
        else:
            self.text.write(text)
            self.size += len(text)

    def _read(self, event: bytes) -> sse.Chunk | None:
        """Keep what a migration needs of one event of the instance's."""
        payload = sse.payload(event)
        if payload is None:
            return None
        if payload == b"[DONE]":
            self.done = True
            return None
        try:
            chunk = sse.decode_chunk(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            self.refused = self.refused or "unreadable"
            return None
        self._keep(chunk)
        return chunk

    def _keep(self, chunk: sse.Chunk) -> None:
        """Keep what a migration needs of one chunk: its id, its text and tokens, the end."""
        if self.id is None and chunk.id is not None:
            self.id, self.created, self.model = chunk.id, chunk.created, chunk.model
        if chunk.usage is not None and not self.resuming:
            self.usage = chunk.usage
        for choice in chunk.choices or ():
            delta = choice.delta
            piece = choice.text if delta is None else delta.content
            if delta is not None and (delta.tool_calls or delta.function_call or
                                      delta.reasoning_content or delta.reasoning):  # fmt: skip
                self.refused = self.refused or _odd(delta)
            if isinstance(piece, str) and piece:
                self.tokens += 1
                if self.size + len(piece) > MAX_CARRIED:
                    self.refused = self.refused or "too_long"
                else:
                    self.text.write(piece)
                    self.size += len(piece)
            if choice.finish_reason is not None:
                self.finished = True
        if chunk.usage is not None:  # (the engine's count: a chunk may carry several tokens)
            self.tokens = max(self.tokens, continuation.counted(chunk.usage, self.carried))

    def _rewrite(self, event: bytes) -> bytes:
        """One event of a continuation as the client's stream has it: its `id` and
        `created`, the role chunk dropped (a role beside content or usage: the role only),
        the usage counting every token sent."""
        chunk = self._read(event)
        if chunk is None:
            return event + b"\n\n"
        choices = chunk.choices
        opened, chat = self.opened, self.chat
        if opened and chat and chunk.usage is None and choices and all(map(sse.opening, choices)):
            return b""  # the continuation's role chunk: the client had one
        roleless = opened and chat and any(sse.has_role(c) for c in choices or ())
        ident = (self.id, self.created)
        out = continuation.event(
            sse.payload(event) or b"", roleless, ident, chunk.usage, self.carried
        )
        if out is None:
            return event + b"\n\n"
        self.opened = True
        return out

    def complete(self) -> bool:
        """Whether a response that ended normally ended the stream (its `[DONE]` came, or
        at least its finish reason: an engine may send no `[DONE]`); counts a migrated
        stream that completed. Events ending with `[DONE]` need no reading."""
        if self.unread and sse.ends_done(self.unread[-1]):  # (each piece is whole events)
            self.done = True
            self.unread, self.unread_size = [], 0
        self.catch_up()
        if not self.parsing or self.done or self.finished:
            if self.migrations:
                self._count("succeeded", self.reason)
            return True
        return False

    def rest(self) -> bytes:
        """At a normal end, what is held of an event the end cut short (`data: [DONE]`
        without its blank line): the client gets it as a stream of one instance would."""
        rest = b"".join(self.pending)
        self.pending, self.pending_size = [], 0
        return rest

    # -- the failure -----------------------------------------------------------------------

    def resume(self, failure: Exception, failed: Upstream | None) -> bool:
        """The instance failed after the client got the first byte: go on elsewhere if the
        stream may. False when it may not (counted, and the caller ends the stream)."""
        self.catch_up()
        if self.refused is None and self.members is None:
            self.refused = self._read_body()
        forward = self.forward
        reason = _failure_kind(failure)
        if not self.failed_at:
            self.failed_at = time.perf_counter()
        if failed is not None:
            forward.tried.append(failed)
        refused = self.refused
        if refused is None and isinstance(failure, ContinuationRefused):
            refused = "continuation_refused"
        if refused is None and (self.finished or self.done):  # (nothing is left to continue)
            refused = "finished"
        if refused is None:  # (no tokens left: the end; a stop string cut at the splice)
            text = self.text.getvalue()
            refused = continuation.halt(self.members or {}, self.chat, text, self.tokens)
            if refused == "length":
                return self._end(reason)
        if refused is None and not self.delivered and self.resuming:
            # The continuation failed before its first event: another try, not a migration.
            self.retries += 1
            if self.retries > forward.proxy.retries:
                refused = "no_instance"
        elif refused is None and self.migrations >= self.limit:
            refused = "limit"
        target = None
        if refused is None:
            ws = self.ws
            if ws is not None:  # (an inhibited one when no other is left, as for a request)
                pick = forward.proxy.router.pick
                target = pick(ws, forward.prompt, forward.tried) or last_resort([ws], forward.tried)
            if target is None:
                refused = "no_instance"
        if refused is not None or target is None:
            refused = refused or "no_instance"
            log.warning(
                "request %s (stream %s): not migrated (%s)", _request_id(forward), self.id, refused
            )
            self._count("refused", refused)
            return False
        body = self._continuation()
        if body is None:
            self._count("refused", "prompt")
            return False
        if failed is not None:
            failed.inhibit(forward.proxy.inhibit_seconds)
            forward.proxy.metrics.instances_inhibited.inc()
        if self.delivered or not self.resuming:
            self.migrations += 1
            self.retries = 0
            self.reason = self.reason or reason
            self._count("attempted", reason)
        log.warning(
            "request %s (stream %s) of %s: instance %s failed after %d tokens (%s); "
            "continuing on instance %s (migration %d of %d)",
            _request_id(forward),
            self.id,
            forward.name,
            "?" if failed is None else f"{failed.instance_id:x}",
            self.tokens,
            failure,
            f"{target.instance_id:x}",
            self.migrations,
            self.limit,
        )
        self.resuming = True
        self.delivered = False
        self.pending, self.pending_size = [], 0
        self.carried = self.tokens
        forward.body = body
        forward.launch(target)
        return True

    def _end(self, reason: str) -> bool:
        """The instance failed with no tokens left: the stream ends as the engine ends it."""
        forward, ident = self.forward, (self.id, self.created, self.model)
        log.warning(
            "request %s (stream %s): ended at its max_tokens", _request_id(forward), self.id
        )
        self._count("ended", reason)
        members, size = self.members or {}, len(forward.origin)
        forward.end(continuation.ending(members, self.chat, ident, self.tokens, self.usage, size))
        return True

    def _continuation(self) -> bytes | None:
        """The request asking an instance to continue the text so far (`continuation.body`)."""
        self.catch_up()
        if not self.size:
            return self.forward.origin  # nothing to continue: the request afresh
        return continuation.body(
            self.forward.origin, self.members, self.chat, self.text.getvalue(), self.tokens
        )

    def _read_body(self) -> str | None:
        """Read the client's body (its members, views of it: a continuation is made of them);
        why it cannot be continued, or None."""
        try:
            self.members = _decode_members(self.forward.origin)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return "body"
        return continuation.refusal(self.members, self.chat)

    def _find_set(self) -> WorkerSet | None:
        """The worker set of the instance answering the first attempt."""
        forward = self.forward
        target, model = forward.target, forward.model
        if target is None or model is None:
            return None
        for ws in model.sets.values():
            if target in ws.routable or any(m.upstream is target for m in ws.members.values()):
                return ws
        return None

    def _count(self, outcome: str, reason: str) -> None:
        self.forward.proxy.metrics.migrations.labels(outcome=outcome, reason=reason).inc()


def _failure_kind(failure: Exception) -> str:
    reason = getattr(failure, "reason", "lost")
    return reason if isinstance(reason, str) else "lost"


def _request_id(forward: Forward) -> str:
    value = forward.request.header(b"x-request-id")
    return "-" if value is None else value.decode("latin-1")
