"""Where an `Upstream` sends its requests: an instance's or a provider's URL read once, into
the fields its connections and requests use (address, host, port, TLS, Basic credentials,
the path prefix and `Host` header, the `x-shoal-instance` label)."""

from __future__ import annotations

import base64
import re
import ssl
import sys
import urllib.parse

from shoal.urls import redact_url

_PLAIN_URL = re.compile(
    r"http://(?P<hostport>(?P<host>[A-Za-z0-9][A-Za-z0-9.-]*):(?P<port>[0-9]{1,5}))"
    r"(?P<path>(?:/[A-Za-z0-9._~/-]*)?)"
)
"""An instance URL as workers announce it, `http://host:port[/path]`: no credentials, no
IPv6 brackets, no query; other URLs take `urllib.parse`."""

Target = tuple[
    int, str, str, str, ssl.SSLContext | None, int, bytes | None, bool, bytes, int, bytes, bytes
]
"""instance_id, url, address, host, tls, port, authorization, provider, path_prefix,
path_skip, host_header, label: `Upstream`'s fields of the same names."""


def parse_target(instance_id: int, url: str, tls: ssl.SSLContext | None, provider: bool) -> Target:
    """The fields of an `Upstream` for `url` (ValueError for a URL it cannot reach)."""
    plain = _PLAIN_URL.fullmatch(url)
    label = f"{instance_id:x}".encode()  # the `x-shoal-instance` of its answers
    if plain is not None and 0 < int(plain["port"]) < 65536:
        # The common form, `http://host:port[/path]`, in one match: a fleet's cold start
        # makes one `Upstream` per instance, and `urlsplit` and its properties cost more.
        prefix = plain["path"].rstrip("/")
        return (
            instance_id, url, url, sys.intern(plain["host"].lower()), None, int(plain["port"]),
            None, provider, (prefix[:-3] if prefix.endswith("/v1") else prefix).encode(),
            3 if provider and not prefix.endswith("/v1") else 0, plain["hostport"].encode(),
            label,
        )  # fmt: skip
    return parse_with_urllib(instance_id, url, tls, provider)


def parse_with_urllib(
    instance_id: int, url: str, tls: ssl.SSLContext | None, provider: bool
) -> Target:
    """What `parse_target` makes of any URL, `urllib.parse` reading it."""
    label = f"{instance_id:x}".encode()
    parts = urllib.parse.urlsplit(url)
    schemes = ("http", "https") if tls is not None else ("http",)
    if parts.scheme not in schemes or not parts.hostname:
        wanted = " or ".join(f"{s}://host:port" for s in schemes)
        # (credentials and a query never go into messages)
        raise ValueError(f"URL {redact_url(url)!r}: only {wanted} URLs are supported")
    host = sys.intern(parts.hostname)  # (one copy per machine, not per instance)
    tls = tls if parts.scheme == "https" else None
    try:
        port = parts.port or (443 if tls is not None else 80)
    except ValueError:  # (urllib's message quotes the "port": a password's start, cut short)
        raise ValueError(f"URL {redact_url(url)!r}: its port is no number in 0-65535") from None
    # Credentials in the URL are sent as Basic auth, never in `Host` nor in messages; a
    # query (never sent: refused in routes) is not shown either.
    hostport = parts.netloc.rpartition("@")[2]
    address = redact_url(urllib.parse.urlunsplit(parts._replace(netloc=hostport)))
    authorization = None
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        authorization = b"Basic " + base64.b64encode(f"{user}:{password}".encode())
    # Requests carry OpenAI paths (/v1/...): a URL ending in /v1 names the same root.
    # A provider's `base_url` ends where `/chat/completions` starts: another base path
    # (`https://host/v1beta/openai`) replaces the `/v1` of requests (`path_skip`).
    prefix = parts.path.rstrip("/")
    return (
        instance_id,
        url,  # as announced (identity for the registry; may hold credentials)
        url if address == url else address,  # (one string, when they are one)
        host,
        tls,
        port,
        authorization,
        provider,
        (prefix[:-3] if prefix.endswith("/v1") else prefix).encode(),
        3 if provider and not prefix.endswith("/v1") else 0,
        (hostport or f"{host}:{port}").encode(),
        label,
    )
