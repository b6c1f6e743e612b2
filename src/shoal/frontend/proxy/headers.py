"""Which headers cross the gateway, each way.

What crosses: a worker gets the client's headers but hop-by-hop ones; a provider (a virtual
model's `url` target, outside the fleet) only those of `PROVIDER_HEADERS`. Every forwarded
request asks for its answer uncompressed (`ACCEPT_IDENTITY`, whatever the client accepts): the
gateway reads answers (a key's usage, a stream that may migrate), and compressed bytes have
no `usage` to charge. Every forwarded request carries this gateway's `Via` entry (`1.1 shoal-<random id>`): a request whose `Via`
names this gateway, or already `MAX_GATEWAY_HOPS` shoal gateways, went round a loop of url
targets and is answered 508. Upstream `Access-Control-*` headers are dropped: the gateway's
own CORS policy alone decides what a browser may read; a provider's cookies, account headers
and rate limits are dropped too (`provider_response_headers`).
"""

from __future__ import annotations

MAX_GATEWAY_HOPS = 8  # shoal gateways a request may pass through (counted in `Via`)

# What a provider gets of the client's headers: what the answer's form depends on, what
# identifies the client software and the request for tracing, the OpenAI beta opt-ins, and
# the `Via` trail (this gateway's entry is added). Never cookies, identity headers a proxy
# in front added (`X-Forwarded-*`), `OpenAI-Organization`/`OpenAI-Project` (which would let
# a client choose what the gateway's key bills), `Origin` or `Referer`.
PROVIDER_HEADERS = frozenset(
    {
        b"content-type",
        b"accept",
        b"user-agent",
        b"x-request-id",
        b"openai-beta",
        b"traceparent",
        b"tracestate",
        b"via",
    }
)

ACCEPT_IDENTITY = b"accept-encoding: identity\r\n"  # sent upstream instead of the client's

# Not forwarded upstream: hop-by-hop headers, and those the proxy sets itself.
REQUEST_HEADERS_DROPPED = frozenset(
    {
        b"host",
        b"content-length",
        b"accept-encoding",
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
RESPONSE_HEADERS_DROPPED = frozenset(
    {
        b"x-shoal-instance",  # the gateway's own: an upstream's would pass for it
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
    }
)


CORS_PREFIX = b"access-control-"  # an upstream's CORS headers: the gateway's policy alone decides

# Dropped from a provider's answers besides: what describes or binds the operator's account
# with the provider (its cookies, organization and project, and its rate limits, which would
# also pass for the gateway's own `x-ratelimit-*` under `--auth keys`).
PROVIDER_RESPONSE_DROPPED = frozenset(
    {b"set-cookie", b"set-cookie2", b"openai-organization", b"openai-project"}
)
PROVIDER_RATELIMIT_PREFIX = b"x-ratelimit-"


def provider_response_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A provider's response headers without `PROVIDER_RESPONSE_DROPPED` and its
    `x-ratelimit-*` (the rest then goes as any upstream's does)."""
    return [
        (name, value)
        for name, value in headers
        if (lname := name.lower()) not in PROVIDER_RESPONSE_DROPPED
        and not lname.startswith(PROVIDER_RATELIMIT_PREFIX)
    ]


MAX_VERDICTS = 1024  # response header names (as sent) whose verdict is kept


RESPONSE_HEADER_RELAYED: dict[bytes, bool] = {}
"""Whether a response header name, as the upstream spelled it, is relayed to the client (but
for one its `Connection:` lists): the verdicts so far, looked up before `response_header_relayed`
works one out (one lookup per header instead of lowering and matching it each time)."""


def response_header_relayed(name: bytes) -> bool:
    """Whether a response header goes to the client: not hop-by-hop, not one the gateway sets,
    not an upstream's CORS header. Remembered for the first `MAX_VERDICTS` names."""
    lname = name.lower()
    relayed = lname not in RESPONSE_HEADERS_DROPPED and not lname.startswith(CORS_PREFIX)
    if len(RESPONSE_HEADER_RELAYED) < MAX_VERDICTS:
        RESPONSE_HEADER_RELAYED[name] = relayed
    return relayed


def relay_response_headers(headers: list[tuple[bytes, bytes]], parts: list[bytes]) -> None:
    """Add to `parts` the lines of the response headers the client gets: those
    `response_header_relayed` lets through, but for those the upstream's `Connection:` lists."""
    mark = len(parts)
    listed: bytes | None = None  # the upstream's `Connection:` value
    verdicts = RESPONSE_HEADER_RELAYED
    for name, value in headers:
        relayed = verdicts.get(name)
        if relayed is None:
            relayed = response_header_relayed(name)
        if relayed:
            parts += (name, b": ", value, b"\r\n")
        elif name.lower() == b"connection":
            listed = value if listed is None else listed + b"," + value
    if listed is not None and (hop := hop_by_hop(listed)):
        del parts[mark:]
        for name, value in headers:
            if response_header_relayed(name) and name.lower() not in hop:
                parts += (name, b": ", value, b"\r\n")


def hop_by_hop(connection: bytes) -> frozenset[bytes]:
    """The header names a `Connection:` value lists, beyond the usual `keep-alive`/`close`:
    they are for this hop only (RFC 9110, 7.6.1), so neither direction forwards them. Never
    the framing headers: each hop frames its own message (a response's `Content-Length`
    dropped left its body unframed on a kept-alive client connection)."""
    names = {token.strip().lower() for token in connection.split(b",")}
    names -= _NEVER_HOP_BY_HOP
    return frozenset(names)


_NEVER_HOP_BY_HOP = frozenset(
    {b"", b"keep-alive", b"close", b"content-length", b"transfer-encoding"}
)
