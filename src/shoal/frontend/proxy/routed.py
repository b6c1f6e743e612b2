"""`VirtualForward`: a request for a virtual model, and what a provider's answer may carry back.

Each attempt picks one of the virtual model's targets by weight; a `url` target is an external
provider reached with the operator's credentials, so its answer is the operator's business
before it is the client's:

- a 401 or 403 refuses the gateway's secret, never the client's key: it is a failed attempt
  (another target is tried) and, when none is left, a 502 `provider_auth_failed` naming the
  provider and the virtual model; the provider's body (which may quote the key) is not relayed.
  A 403 denies the key this model: that target is inhibited. A 401 refuses the key itself:
  every target on it (the same base URL and secret) is inhibited at once;
- any other body, whatever its status (an error, a redirect's page, a 200 echoing the
  `Authorization` it got), is relayed with the secret's value masked in every form it may be
  written in, JSON-escaped, URL-encoded, HTML-escaped (`virtual.masking.Masked`, same length,
  so a `Content-Length` still holds): the value the request was written with, and the one in
  force when the answer comes (a rotation in between leaves the old one valid at the provider);
- a body under any coding but identity (a `Content-Encoding`, or a `Transfer-Encoding` other
  than chunked: the gateway asks for identity, and a compressed body could not be masked) is
  not relayed: a failed attempt, and when none is left a 502 `provider_encoding` naming the
  provider and the header (its value masked);
- its cookies, account headers and rate limits are dropped (`provider_response_headers`), and
  any other header (of any answer) quoting the secret, in any form, has it masked.
"""

from __future__ import annotations

import logging

from shoal.cards import ModelType
from shoal.frontend.http import errors
from shoal.frontend.http.request import ClientConnection, Request
from shoal.frontend.http.upstream import Upstream
from shoal.frontend.proxy.fields import (
    LARGE_BODY,
    Fields,
    Members,
    members_later,
    rewrite_model,
)
from shoal.frontend.proxy.forward import Forward, Gateway
from shoal.frontend.proxy.headers import provider_response_headers
from shoal.frontend.registry.metrics import ModelStats
from shoal.frontend.virtual.masking import Masked
from shoal.frontend.virtual.targets import FleetChoice, UrlChoice
from shoal.frontend.virtual.virtual import VirtualModel
from shoal.openai import ApiError
from shoal.urls import redact_url

log = logging.getLogger(__name__)

BEARER = b"Bearer "
CODINGS = {b"content-encoding": ("Content-Encoding", (b"identity",)),
           b"transfer-encoding": ("Transfer-Encoding", (b"chunked", b"identity"))}  # fmt: skip
"""The headers that name a coding, and the codings under which a body can be masked."""


def _encoding(headers: list[tuple[bytes, bytes]]) -> str | None:
    """A coding the body is under that is not identity (or chunked, for `Transfer-Encoding`),
    as `Header 'value'` (None: none). Any other coding (gzip, a quoted or unknown token) hides
    the body's bytes from masking."""
    for name, value in headers:
        known = CODINGS.get(name.lower()) if len(name) in (16, 17) else None
        if known is None:
            continue
        header, plain = known
        for coding in value.split(b","):
            coding = coding.strip().lower()
            if coding and coding not in plain:
                return f"{header} {value.decode('latin-1')[:64]!r}"
    return None


class VirtualForward(Forward):
    """A request for a virtual model: each attempt picks one of its targets by weight, and
    sends the body naming the model as that target serves it (re-encoded only then)."""

    __slots__ = ("kind", "masked", "members", "pieces", "sent", "served", "virtual")

    def __init__(
        self,
        proxy: Gateway,
        request: Request,
        client: ClientConnection,
        virtual: VirtualModel,
        kind: ModelType,
        fields: Fields,
        stats: ModelStats,
    ) -> None:
        super().__init__(proxy, request, client, None, fields, stats)
        self.virtual = virtual
        self.kind = kind
        self.served = self.name  # the model the body names now
        self.masked: Masked | None = None  # a provider's body, its secret masked
        self.pieces: list[bytes] = []  # the pieces of a provider's body of this read, to mask
        self.sent: bytes | None = None  # the `Authorization` the attempt was written with
        self.members: Members | None = None  # a large body's, for `rewrite_model` (`start`)

    def start(self) -> None:
        """A large body that a target may be sent renamed has its top-level members decoded
        before the first attempt, in the decoder process: with its fields, as a rule
        (`Request.members`), else now (`members_later`). A rewrite then only encodes them, on
        the event loop (parsing 9 MB there again held it as long as the first decode)."""
        members = self.request.members
        if members is not None:
            self.members = members
            super().start()
        elif self.virtual.renames and self.request.size >= LARGE_BODY:
            members_later(self.request.body, self.client, self._with_members)
        else:
            super().start()

    def _with_members(self, members: Members | ApiError) -> None:
        if isinstance(members, ApiError):  # (too many members to rebuild it: a 400)
            self.client.send_error(members)
            return
        self.members = members
        try:
            super().start()
        except Exception:  # (as `Proxy.handle` answers a bug: this request's alone)
            log.exception("request %s failed in the gateway", self.name)
            self.client.send_error(errors.internal_error())

    def _models(self) -> tuple[str, ...]:
        return tuple(c.served for c in self.virtual.weighted if isinstance(c, FleetChoice))

    def _pick(self) -> Upstream | None:
        picked = self.virtual.choose(self.kind, self.proxy.router, self.prompt, self.tried)
        if picked is None:
            return None
        target, served = picked
        if served != self.served:
            self.served = served
            body = self.request.body
            if served == self.name:
                self.body = body
            else:
                self.body = rewrite_model(body, served, self.members)
        return target

    def _head(self, target: Upstream, body: bytes) -> bytes:
        # The secret as written now: a rotation (`RouteTable.refresh_secrets`) may replace the
        # target's before the answer comes, and the provider may quote this one, still valid.
        self.sent = target.authorization
        return super()._head(target, body)

    def _may_retry(self) -> bool:
        if self.attempt > self.proxy.retries:
            return False
        target = self.target
        tried = self.tried if target is None else [*self.tried, target]
        return self.virtual.untried(self.kind, tried)

    # -- a provider's answer (see the module) -------------------------------------------------

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], chunked: bool) -> bool:
        self.masked = None
        self.pieces.clear()
        target = self.target
        if target is None or not target.provider or self.started:
            return super().on_head(status, headers, chunked)
        if status == 401 or status == 403:
            refused = errors.provider_refused(self.name, self._provider(target), status)
            if status == 401:  # (the key: every model on it; a 403, this model: `_attempt_failed`)
                self._refuse_key(target)
            self._attempt_failed(refused)
            return False
        sent, now = self.sent, target.authorization  # (the key sent, and the one in force)
        secrets = [a[len(BEARER) :] for a in (sent, now) if a is not None and a.startswith(BEARER)]
        masked = Masked(*secrets) if secrets else None
        if masked is not None:  # (first: the 502 and the log below quote a header's value)
            headers = masked.headers(headers)
        encoding = _encoding(headers)
        if encoding is not None:
            provider = self._provider(target)
            self._attempt_failed(errors.provider_encoded(self.name, provider, encoding))
            return False
        self.masked = masked
        return super().on_head(status, provider_response_headers(headers), chunked)

    def on_body(self, data: bytes) -> None:
        if self.masked is not None:  # (masked once a read, in `flush`: not once a chunk)
            self.pieces.append(data)
            return
        super().on_body(data)

    def _masked_pieces(self, masked: Masked) -> None:
        pieces = self.pieces
        data = masked.feed(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        pieces.clear()
        if data:  # (an empty piece would end a chunked body)
            super().on_body(data)

    def flush(self, final: bool = False) -> None:
        masked = self.masked
        if masked is not None and self.pieces:
            self._masked_pieces(masked)
        super().flush(final)

    def on_packet(self, bodies: list[bytes]) -> None:
        if self.masked is None:
            super().on_packet(bodies)
            return
        for data in bodies:  # (every piece masked: never the short way)
            self.on_body(data)
        self.flush()

    def on_complete(self) -> None:
        masked = self.masked
        if masked is not None:
            if self.pieces:
                self._masked_pieces(masked)
            if rest := masked.rest():
                super().on_body(rest)
        super().on_complete()

    def _choice(self, target: Upstream) -> UrlChoice | None:
        for choice in self.virtual.choices:
            if isinstance(choice, UrlChoice) and choice.upstream is target:
                return choice
        return None

    def _provider(self, target: Upstream) -> str:
        """How the provider behind `target` is named to clients: its catalog name and URL."""
        choice = self._choice(target)
        if choice is None:
            return redact_url(target.address)
        url = redact_url(choice.target.base_url)
        name = choice.target.provider
        return f"`{name}` ({url})" if name else url

    def _refuse_key(self, target: Upstream) -> None:
        """The provider refused the key `target` sends (401): inhibit every other target on
        it (`target` itself is, as a failed attempt)."""
        choice = self._choice(target)
        seconds = self.proxy.inhibit_seconds
        for upstream in () if choice is None else choice.on_key:
            if upstream is not target and not upstream.inhibited:
                upstream.inhibit(seconds)
                self.proxy.metrics.instances_inhibited.inc()
