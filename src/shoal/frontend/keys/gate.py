"""`Gate`: the path of a request made with an API key, between its check and the proxy.

    max_parallel (this frontend) → rpm/tpm (`Limits.admit`: decided here for a key without
    limits, on the fallback's local windows, or on the key's allowance; else the request
    waits for Redis' answer, `Limits.wait`) → the proxy, answering through `Metered` → at the
    end (`done`): the request leaves max_parallel, its tokens are charged to tpm, and its
    usage is recorded.

A refused request answers 429 with `Retry-After` and the `x-ratelimit-*` headers (an admitted
one gets the headers too). While it waits for Redis, the request is the connection's response
in progress (`_Waiting`): a client that leaves cancels it, and it is not forwarded.
Nothing here allocates per request beyond the `Metered` connection (and `_Waiting` if Redis
decides).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shoal.cards import ModelType
from shoal.discovery.grants import Grant
from shoal.frontend.http.request import ClientConnection, Request
from shoal.frontend.http.server import HttpConnection
from shoal.frontend.keys.limits import Limits, rate_limited
from shoal.frontend.keys.metering import Metered
from shoal.frontend.keys.windows import Refusal

# request, connection, kind, its body's fields as the caller decoded them (the proxy's
# `Fields`, opaque here: passed on as they are, so the body is decoded once), and the key's
# workspace (whose virtual models alone the key sees)
Forward = Callable[[Request, ClientConnection, ModelType, Any, str], None]
# grant, model, served model, status, prompt tokens, completion tokens
Record = Callable[[Grant, str, str, int, int, int], None]


class _Waiting:
    """A request waiting for Redis' answer: the connection's response until it comes."""

    __slots__ = ("cancelled", "conn", "fields", "gate", "kind", "metered", "request", "tokens")

    def __init__(
        self,
        gate: Gate,
        request: Request,
        conn: HttpConnection,
        metered: Metered,
        kind: ModelType,
        tokens: int,
        fields: Any,
    ) -> None:
        self.gate = gate
        self.request = request
        self.conn = conn
        self.metered = metered
        self.kind = kind
        self.tokens = tokens  # its estimate, made once (`Limits` reads it at every answer)
        self.fields = fields  # its body's, decoded once: the proxy's too
        self.cancelled = False

    @property
    def ticket(self) -> Metered:
        return self.metered

    def cancel(self) -> None:
        """The client left while Redis answered."""
        if not self.cancelled:
            self.cancelled = True
            self.gate.limits.leave(self.metered.grant)

    def admitted(self, headers: bytes) -> None:
        self.conn.extra_headers += headers
        grant = self.metered.grant
        self.gate.forward(self.request, self.metered, self.kind, self.fields, grant.workspace)

    def refused(self, refusal: Refusal) -> None:
        self.conn.extra_headers += refusal.headers
        self.metered.send_error(rate_limited(self.metered.grant, refusal))


class Gate:
    def __init__(self, limits: Limits, forward: Forward, record: Record | None = None) -> None:
        self.limits = limits
        self.forward = forward
        self.record = record
        self.records_usage = record is not None

    def handle(
        self,
        request: Request,
        conn: HttpConnection,
        kind: ModelType,
        grant: Grant,
        model: str,
        tokens: int,
        fields: Any,
        hide_usage: bool = False,
    ) -> None:
        """A request of `grant`'s key for `model`; `tokens`: its `windows.estimate`, made
        once by the caller that decoded its `fields` (once: the proxy is given them, and
        never decodes the body again); `hide_usage`: its stream asks the engine for a usage
        event its client did not ask for (`Metered` reads it, the client never sees it)."""
        limits = self.limits
        if grant.max_parallel is not None:
            refused = limits.enter(grant)
            if refused is not None:
                conn.send_error(refused)
                if self.record is not None:
                    self.record(grant, model, model, refused.status, 0, 0)
                return
        metered = Metered(conn, request.size, self, grant, model, hide_usage)
        verdict = limits.admit(grant, tokens, metered)
        if verdict is None:
            waiting = _Waiting(self, request, conn, metered, kind, tokens, fields)
            conn.produce_later(waiting)
            limits.wait(grant, waiting)
        elif isinstance(verdict, bytes):
            if verdict:
                conn.extra_headers += verdict
            self.forward(request, metered, kind, fields, grant.workspace)
        else:
            conn.extra_headers += verdict.headers
            metered.send_error(rate_limited(grant, verdict))

    def done(
        self,
        grant: Grant,
        model: str,
        status: int,
        prompt: int,
        completion: int,
        served: str,
        reserved: int = 0,
        shared: bool = False,
        minute: int = 0,
    ) -> None:
        """The end of a request that passed max_parallel (`Metered` tells it, once), with
        the tokens reserved for it when admitted (`shared`: in Redis), in `minute`."""
        limits = self.limits
        if grant.max_parallel is not None:
            limits.leave(grant)
        if grant.tpm is not None:
            limits.charge(grant, prompt + completion, reserved, shared, minute)
        if self.record is not None:
            self.record(grant, model, served or model, status, prompt, completion)
