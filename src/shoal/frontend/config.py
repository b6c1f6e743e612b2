"""What a `Frontend` is given: its settings (`FrontendConfig`), the membership watch it may
follow (`MembershipFollower`, built by `shoal.cli`), and the TLS contexts its settings name.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shoal.discovery import Query
from shoal.frontend.registry.metadata import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILE_BYTES


@dataclass
class FrontendConfig:
    """Every setting of a frontend; the CLI fills it from flags and `SHOAL_*` variables."""

    store_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    namespaces: tuple[str, ...] = ()
    router: str = "round-robin"
    reconcile_interval: float = 30.0
    api_keys: tuple[str, ...] = ()
    max_body: int = 16 * 1024 * 1024
    retries: int = 2
    inhibit_seconds: float = 5.0
    first_byte_timeout: float = 60.0  # seconds for a worker to start answering; 0: no limit
    upstream_idle_timeout: float = 60.0  # seconds a worker may pause mid-response; 0: no limit
    migration_limit: int = 1  # times a stream may move to another instance mid-stream; 0: never
    cache_dir: Path | None = None
    metadata_timeout: float = 30.0
    metadata_cache_bytes: int = DEFAULT_MAX_BYTES
    metadata_max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    connect_timeout: float = 5.0
    drain_timeout: float = 30.0
    keepalive_timeout: float = 75.0
    header_timeout: float = 10.0  # seconds to receive a request head; 0: no limit
    body_timeout: float = 30.0  # seconds between request body bytes; 0: no limit
    send_timeout: float = 60.0  # seconds a client may read nothing of its answer; 0: no limit
    max_connections: int = 10_000
    max_body_memory: int = 1 << 30  # bytes of request bodies held by all the connections
    max_header_size: int = 64 * 1024  # bytes of request line and headers
    max_headers: int = 100
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any)
    public_health: bool = False  # with API keys, `/health` details without the key too
    metrics_port: int | None = None  # serve `/metrics` on this port (same host) instead
    setup_timeout: float = 10.0  # seconds for the store to answer the first listing
    # `gc.freeze()` what the first load builds (process-wide: `shoal frontend` sets it).
    freeze_loading: bool = False
    # The scope follows a membership watch (built by `shoal.cli`) instead of `namespaces`:
    namespace_sources: Path | None = None
    namespaces_from_discovery: bool = False
    endpoint_prefixes: tuple[str, ...] = ()
    kv_overlap_weight: float = 2.0  # the kv policy: cost of an uncached block vs one of load
    kv_events: str | None = None  # the kv policy: nats://... reads the relay's stream, not ZMQ
    kv_stream: str = "shoal-kv"
    # Virtual models: the workspaces whose routes are served (the first wins a name clash),
    # where providers' secrets are files, and a CA file to trust beside the system's.
    workspaces: tuple[str, ...] = ("default",)
    secrets_dir: Path | None = None
    provider_ca_file: Path | None = None
    # Serve HTTPS instead of HTTP (both files, PEM).
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = None
    # One of several processes listening on `port` (`SO_REUSEPORT`; `shoal.cli.processes`).
    reuse_port: bool = False
    # `keys`: requests need a catalog API key (or an `api_keys` one), checked against the
    # grants of `workspaces` in the store, hashed with `key_pepper` (see `keys`).
    auth: str = "api-key"
    key_pepper: str = ""
    limits_url: str | None = None  # redis://HOST:6379: rpm and tpm shared by the frontends
    catalog_url: str | None = None  # where the keys' usage is flushed (`POST /v1/usage`)
    catalog_token: str | None = None
    usage_interval: float = 10.0  # seconds between two flushes of usage


class MembershipView(Protocol):
    """The namespaces in force and their queries (`shoal.membership.Membership`)."""

    @property
    def scopes(self) -> Mapping[str, tuple[Query, ...]]: ...

    def to_dict(self) -> dict[str, Any]: ...

    async def json(self) -> bytes:
        """`to_dict()` as JSON, made off the event loop."""
        ...


class MembershipStatusView(Protocol):
    @property
    def applied_revision(self) -> str | None: ...

    @property
    def last_error(self) -> str | None: ...

    def to_dict(self) -> dict[str, Any]: ...


class MembershipFollower(Protocol):
    """What the frontend needs of a membership watch (`shoal.membership.MembershipWatch`).

    Layer-5 packages do not import each other: `shoal.cli` builds the watch and hands the
    frontend a factory of it; the frontend only subscribes to its views.
    """

    @property
    def view(self) -> MembershipView: ...

    @property
    def status(self) -> MembershipStatusView: ...

    def subscribe(self, callback: Callable[[MembershipView], None]) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def provider_tls(ca_file: Path | None) -> ssl.SSLContext:
    """The client context for HTTPS providers: the system's CAs (and `ca_file`'s), SNI and
    certificate verification on, HTTP/1.1."""
    context = ssl.create_default_context()
    if ca_file is not None:
        context.load_verify_locations(cafile=str(ca_file))
    context.set_alpn_protocols(["http/1.1"])
    return context


def server_tls(certfile: Path | None, keyfile: Path | None) -> ssl.SSLContext | None:
    """The server context for `--tls-certfile`/`--tls-keyfile`, or None to serve plain HTTP."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise ValueError("--tls-certfile and --tls-keyfile go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(certfile), str(keyfile))
    except OSError as exc:  # ssl.SSLError too: the files exist but do not hold a key pair
        reason = exc.strerror or str(exc)
        raise ValueError(
            f"cannot load the certificate {certfile} and key {keyfile}: {reason}"
        ) from None
    context.set_alpn_protocols(["http/1.1"])
    return context


def url_host(host: str) -> str:
    """`host` as a URL on this machine names a server bound to it: a wildcard becomes
    127.0.0.1, an IPv6 address is bracketed (`http://[::1]:8000`)."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
