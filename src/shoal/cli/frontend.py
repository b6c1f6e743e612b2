"""`shoal frontend`: the OpenAI-compatible gateway for the models workers announce.

Prints `shoal frontend ready: url=http://HOST:PORT` on stdout once it serves (with
`--port 0`, the port the system chose); drains on SIGINT, SIGTERM or SIGHUP. With `--processes N`
above 1, a supervisor runs N frontend processes on the port (`shoal.cli.processes`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import sys
from pathlib import Path

from shoal import membership
from shoal.cli.common import (
    COUNT,
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    PROCESSES,
    SECONDS,
    SECONDS_OR_ZERO,
    add_flag,
    on_stop_signals,
    print_ready,
    run_event_loop,
)
from shoal.cli.scope import add_membership_flags, check_membership_flags, membership_for
from shoal.frontend import POLICIES, Frontend, FrontendConfig
from shoal.frontend.registry.metadata import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILE_BYTES
from shoal.kv.stream import DEFAULT_STREAM
from shoal.store import StoreError

log = logging.getLogger(__name__)


def add_frontend_flags(parser: argparse.ArgumentParser, *, port: int = 8000) -> None:
    """The flags `shoal frontend` and `shoal up` share."""
    add_flag(
        parser,
        "--store",
        help="discovery store URL (memory://, sqlite:///path, etcd://host:port); "
        "default: the SQLite file in the user state dir",
    )
    add_flag(parser, "--host", "127.0.0.1", help="address to listen on")
    add_flag(
        parser,
        "--port",
        port,
        type=PORT,
        help=f"port to listen on (0: any free port; default {port})",
    )
    add_flag(
        parser,
        "--router",
        "round-robin",
        choices=POLICIES,
        help="routing policy (default round-robin)",
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "frontend",
        help="serve the OpenAI API for the fleet's models",
        description="Serve an OpenAI-compatible API, routing each request to a live worker.",
    )
    add_frontend_flags(parser)
    add_flag(
        parser,
        "--processes",
        1,
        type=PROCESSES,
        metavar="N",
        help="frontend processes sharing the port, each with its own event loop, supervised by "
        "one parent (auto: one per core this process may use, within its CPU quota; default "
        "1); see docs/operations.md",
    )
    add_membership_flags(parser)
    add_flag(
        parser,
        "--kv-overlap-weight",
        2.0,
        type=NON_NEGATIVE,
        help="--router kv: cost of one uncached prompt block against one block of load (default 2)",
    )
    add_flag(
        parser,
        "--kv-events",
        metavar="nats://HOST:4222[,...]",
        help="--router kv: read KV events from the relay's JetStream stream (shoal kv-relay) "
        "instead of each worker's ZMQ publisher",
    )
    add_flag(
        parser,
        "--kv-stream",
        DEFAULT_STREAM,
        help=f"with --kv-events: the stream to read (default {DEFAULT_STREAM})",
    )
    add_flag(
        parser,
        "--reconcile-interval",
        30,
        type=SECONDS,
        help="seconds between reconciliations with discovery (default 30)",
    )
    add_flag(
        parser,
        "--api-key",
        action="append",
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1 routes, the dashboard's data and "
        "/health's details (repeatable)",
    )
    add_flag(
        parser,
        "--metrics-port",
        type=PORT,
        metavar="PORT",
        help="serve /metrics on this port (same --host, plain HTTP) and not on --port: a "
        "port for the scraper that clients are not routed to (default: on --port)",
    )
    add_flag(
        parser,
        "--public-health",
        action="store_true",
        help="with --api-key, still show /health's details (models, providers, cache) to "
        "callers without a key; without it they get only the status and its reasons",
    )
    add_flag(
        parser,
        "--auth",
        "api-key",
        choices=("api-key", "keys"),
        help="keys: require a catalog API key of the --workspaces (its allow-list and limits; "
        "--api-key ones stay valid); default api-key: only --api-key, if any",
    )
    add_flag(
        parser,
        "--key-pepper",
        "",
        help="the catalog's --key-pepper, hashed with the API keys (SHOAL_KEY_PEPPER)",
    )
    add_flag(
        parser,
        "--limits",
        metavar="URL",
        help="redis://HOST:6379: the API keys' rpm and tpm shared by every frontend (default: "
        "each frontend limits alone)",
    )
    add_flag(
        parser,
        "--catalog-url",
        metavar="URL",
        help="the catalog API, where the API keys' usage is flushed every 10 s "
        "(SHOAL_CATALOG_URL; default: usage is not recorded)",
    )
    add_flag(
        parser,
        "--catalog-token",
        env="admin_token",
        help="the catalog's admin token (SHOAL_ADMIN_TOKEN)",
    )
    add_flag(
        parser,
        "--max-body",
        16 * 1024 * 1024,
        type=POSITIVE,
        metavar="BYTES",
        help="largest request body accepted (default 16 MiB)",
    )
    add_flag(
        parser,
        "--retries",
        2,
        type=COUNT,
        help="other instances to try after a failure before the first byte (default 2)",
    )
    add_flag(
        parser,
        "--inhibit-seconds",
        5,
        type=SECONDS_OR_ZERO,
        help="how long a failed instance gets no requests (default 5)",
    )
    add_flag(
        parser,
        "--first-byte-timeout",
        60,
        type=SECONDS_OR_ZERO,
        metavar="SECONDS",
        help="how long an instance may take to start answering before the request is retried "
        "elsewhere (and answered 504 when none does); 0: no limit (default 60)",
    )
    add_flag(
        parser,
        "--upstream-idle-timeout",
        60,
        type=SECONDS_OR_ZERO,
        metavar="SECONDS",
        help="how long an instance may send nothing in the middle of a response before it is "
        "ended (a stream with an SSE error event); 0: no limit (default 60)",
    )
    add_flag(
        parser,
        "--migration-limit",
        1,
        type=COUNT,
        metavar="N",
        help="times a stream whose instance fails after its first token may be continued on "
        "another instance (a card's runtime_config migration_limit sets its own); 0: never "
        "(default 1)",
    )
    add_flag(
        parser,
        "--cache-dir",
        type=Path,
        help="where verified model metadata files are kept (default: the user cache dir)",
    )
    add_client_limit_flags(parser)
    add_flag(
        parser,
        "--metadata-cache-bytes",
        DEFAULT_MAX_BYTES,
        type=COUNT,
        metavar="BYTES",
        help="size of the metadata cache; least recently used files leave first (default 1 GiB)",
    )
    add_flag(
        parser,
        "--metadata-max-file-bytes",
        DEFAULT_MAX_FILE_BYTES,
        type=POSITIVE,
        metavar="BYTES",
        help="largest metadata file a card may declare; larger ones are refused (default 64 MiB)",
    )
    add_flag(
        parser,
        "--setup-timeout",
        10,
        type=SECONDS,
        metavar="SECONDS",
        help="how long the store may take to answer the first listing (not to load the "
        "fleet it lists: that takes as long as it needs, its progress in /health), and the namespace "
        "membership to set up its first selection (each bound on its own), before the frontend "
        "exits with an error naming what failed; outages after start are survived; also the "
        "time bound of each later membership update (default 10)",
    )
    add_flag(
        parser,
        "--drain-timeout",
        30,
        type=SECONDS_OR_ZERO,
        help="seconds to let requests in flight finish on shutdown (default 30)",
    )
    add_virtual_model_flags(parser)
    add_flag(
        parser,
        "--tls-certfile",
        type=Path,
        metavar="PEM",
        help="serve HTTPS with this certificate (chain); needs --tls-keyfile",
    )
    add_flag(
        parser,
        "--tls-keyfile",
        type=Path,
        metavar="PEM",
        help="the private key of --tls-certfile",
    )


def add_virtual_model_flags(parser: argparse.ArgumentParser) -> None:
    """Which routes the frontend serves, and how it reaches external providers."""
    add_flag(
        parser,
        "--workspace",
        action="append",
        metavar="NAME",
        help="serve the virtual models of this catalog workspace (repeatable; the first wins "
        "a name defined in several; default: default)",
    )
    add_flag(
        parser,
        "--secrets-dir",
        type=Path,
        metavar="DIR",
        help="directory of provider secrets, one file per secret name (checked after the "
        "SHOAL_SECRET_<NAME> variables)",
    )
    add_flag(
        parser,
        "--provider-ca-file",
        type=Path,
        metavar="PEM",
        help="also trust this CA for HTTPS providers (self-hosted ones, tests)",
    )


def add_client_limit_flags(parser: argparse.ArgumentParser) -> None:
    """What one client may cost the gateway, and which browser pages may call it."""
    add_flag(
        parser,
        "--header-timeout",
        10,
        type=SECONDS_OR_ZERO,
        metavar="SECONDS",
        help="time to receive a request head, from its first byte (or the connection's "
        "start); 0: no limit (default 10)",
    )
    add_flag(
        parser,
        "--body-timeout",
        30,
        type=SECONDS_OR_ZERO,
        metavar="SECONDS",
        help="longest gap between request body bytes; 0: no limit (default 30)",
    )
    add_flag(
        parser,
        "--send-timeout",
        60,
        type=SECONDS_OR_ZERO,
        metavar="SECONDS",
        help="longest a client may read nothing of its answer while it waits to be sent (its "
        "connection closes and the instance's request stops, as nginx's send_timeout); "
        "0: no limit (default 60)",
    )
    add_flag(
        parser,
        "--max-connections",
        10_000,
        type=POSITIVE,
        help="client connections served at once; others get 503 (default 10000)",
    )
    add_flag(
        parser,
        "--max-body-memory",
        1 << 30,
        type=POSITIVE,
        metavar="BYTES",
        help="bytes of request bodies held at once by all the connections, as they arrive "
        "or wait their turn; the request crossing it gets 503 (default 1 GiB)",
    )
    add_flag(
        parser,
        "--max-header-size",
        64 * 1024,
        type=POSITIVE,
        metavar="BYTES",
        help="largest request line plus headers; larger gets 431 (default 65536)",
    )
    add_flag(
        parser,
        "--max-headers",
        100,
        type=POSITIVE,
        help="most request headers; more gets 431 (default 100)",
    )
    add_flag(
        parser,
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (e.g. https://app.example, or *) call the API "
        "(repeatable; default: none)",
    )


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    # Numeric ranges are checked by the flags' types (`shoal.cli.common.number`).
    check_membership_flags(args)
    setup_timeout = args.setup_timeout
    if (args.tls_certfile is None) != (args.tls_keyfile is None):
        raise ValueError("--tls-certfile and --tls-keyfile go together")
    if args.kv_events is not None:
        if args.router != "kv":
            raise ValueError("--kv-events needs --router kv")
        for url in args.kv_events.split(","):
            if not url.startswith(("nats://", "tls://")):
                raise ValueError(f"--kv-events: {url!r} is not a nats://HOST:PORT URL")
    for workspace in args.workspace:
        if not workspace:
            raise ValueError("--workspace must not be empty")
    if args.max_body_memory < args.max_body:  # (a body over it: 503 'retry shortly', for good)
        raise ValueError(
            f"--max-body-memory ({args.max_body_memory}) is below --max-body ({args.max_body}): "
            "a body between them could never be received; raise it, or lower --max-body"
        )
    return FrontendConfig(
        store_url=args.store,
        host=args.host,
        port=args.port,
        namespaces=tuple(args.namespace),
        namespace_sources=args.namespace_sources,
        namespaces_from_discovery=args.namespaces_from_discovery,
        endpoint_prefixes=tuple(args.endpoint_prefix),
        router=args.router,
        kv_overlap_weight=args.kv_overlap_weight,
        kv_events=args.kv_events,
        kv_stream=args.kv_stream,
        reconcile_interval=args.reconcile_interval,
        api_keys=tuple(args.api_key),
        public_health=args.public_health,
        metrics_port=args.metrics_port,
        auth=args.auth,
        key_pepper=args.key_pepper,
        limits_url=args.limits,
        catalog_url=args.catalog_url,
        catalog_token=args.catalog_token,
        max_body=args.max_body,
        retries=args.retries,
        inhibit_seconds=args.inhibit_seconds,
        first_byte_timeout=args.first_byte_timeout,
        upstream_idle_timeout=args.upstream_idle_timeout,
        migration_limit=args.migration_limit,
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        metadata_cache_bytes=args.metadata_cache_bytes,
        metadata_max_file_bytes=args.metadata_max_file_bytes,
        drain_timeout=args.drain_timeout,
        setup_timeout=setup_timeout,
        freeze_loading=True,  # (this process is the frontend's own)
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        send_timeout=args.send_timeout,
        max_connections=args.max_connections,
        max_body_memory=args.max_body_memory,
        max_header_size=args.max_header_size,
        max_headers=args.max_headers,
        cors_origins=tuple(args.cors_origin),
        workspaces=tuple(args.workspace) or ("default",),
        secrets_dir=args.secrets_dir,
        provider_ca_file=args.provider_ca_file,
        tls_certfile=args.tls_certfile,
        tls_keyfile=args.tls_keyfile,
    )


async def start_frontend(config: FrontendConfig, failed: str) -> Frontend | None:
    """The started frontend; `None` once a store, socket or settings error is printed to
    stderr after `failed`."""
    frontend = Frontend(config, membership=membership_for(config))
    try:
        await frontend.start()
    except (StoreError, OSError, ValueError, membership.MembershipError) as exc:
        print(f"{failed}: {exc}", file=sys.stderr)
        await frontend.stop()
        return None
    except asyncio.CancelledError:  # stopped while starting (loading a large fleet)
        await frontend.stop()
        raise
    return frontend


async def trim_once_loaded(frontend: Frontend) -> bool:
    """Once a start's metadata fetches are all done, give the C library's free memory back
    to the system (glibc's `malloc_trim`, in a thread: it holds no Python lock). A cold start
    frees the downloads' buffers and the listings' values while the registry grows around
    them, and glibc keeps those pages: 2 KB per instance of RSS. False where there is no
    `malloc_trim` (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    if frontend.watcher is not None:
        await frontend.watcher.no_fetches.wait()
    await asyncio.to_thread(trim, 0)
    return True


async def serve(config: FrontendConfig) -> int:
    stop = asyncio.Event()
    on_stop_signals(stop)
    # A stop signal while discovery loads (a large fleet takes its time) ends the start.
    starting = asyncio.create_task(start_frontend(config, "shoal frontend"))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        log.info("stopping while starting")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return 0
    frontend = starting.result()
    if frontend is None:
        return 1
    print_ready("frontend", url=frontend.url)
    trimming = asyncio.create_task(trim_once_loaded(frontend), name="malloc_trim")
    await stop.wait()
    trimming.cancel()
    log.info("stopping: draining requests in flight")
    await frontend.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"shoal frontend: {exc}", file=sys.stderr)
        return 2
    if args.processes > 1:
        from shoal.cli.processes import supervise

        return run_event_loop(supervise(config, args.processes))
    return run_event_loop(serve(config))
