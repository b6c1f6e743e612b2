"""`shoal kv-relay`: the KV events of a membership view's workers, republished to NATS JetStream.

Prints `shoal kv-relay ready: status=http://HOST:PORT` (with `--status-port`; `status=none`
without) once its first membership selection is in force; stops on SIGINT, SIGTERM or SIGHUP.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from shoal import membership
from shoal.cli.common import (
    PORT,
    POSITIVE,
    SECONDS,
    add_flag,
    number,
    on_stop_signals,
    print_ready,
    run_event_loop,
)
from shoal.cli.scope import (
    add_membership_flags,
    check_membership_flags,
    membership_source,
    membership_watch,
)
from shoal.discovery import Discovery
from shoal.kv.stream import DEFAULT_STREAM
from shoal.relay import KvRelay, RelayConfig, StatusServer
from shoal.store import StoreError, open_store

log = logging.getLogger(__name__)

BYTES_OR_UNBOUNDED = number(int, low=-1)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "kv-relay",
        help="relay the KV cache events of a membership's workers to NATS JetStream",
        description="Follow a namespace membership, subscribe to each member's KV events and "
        "republish them to a JetStream stream that frontends (--kv-events nats://...) read.",
    )
    add_flag(
        parser,
        "--store",
        help="discovery store URL (memory://, sqlite:///path, etcd://host:port); "
        "default: the SQLite file in the user state dir",
    )
    add_membership_flags(parser, what="relay")
    add_flag(
        parser,
        "--nats",
        "nats://127.0.0.1:4222",
        metavar="URL[,URL]",
        help="NATS servers, comma-separated (default nats://127.0.0.1:4222)",
    )
    add_flag(
        parser,
        "--nats-creds",
        type=Path,
        metavar="FILE",
        help="NATS credentials file, read again at each connection (a sources file's new "
        "connection_revision makes one)",
    )
    add_flag(
        parser, "--stream", DEFAULT_STREAM, help=f"JetStream stream (default {DEFAULT_STREAM})"
    )
    add_flag(
        parser,
        "--max-age",
        600,
        type=SECONDS,
        help="seconds the stream keeps a record, when the relay creates it (default 600)",
    )
    add_flag(
        parser,
        "--max-bytes",
        1 << 30,
        type=BYTES_OR_UNBOUNDED,
        metavar="BYTES",
        help="bytes the stream keeps, when the relay creates it; -1: no bound (default 1 GiB)",
    )
    add_flag(
        parser,
        "--buffer",
        10_000,
        type=POSITIVE,
        metavar="RECORDS",
        help="records queued per member while NATS does not take them; past that the member's "
        "events are left in the worker's replay buffer and read when NATS takes records again "
        "(default 10000)",
    )
    add_flag(parser, "--host", "127.0.0.1", help="address of the status server")
    add_flag(
        parser,
        "--status-port",
        type=PORT,
        help="serve /health, /v1/membership/status and /metrics here (0: any free port)",
    )
    add_flag(
        parser,
        "--setup-timeout",
        10,
        type=SECONDS,
        metavar="SECONDS",
        help="how long the first membership selection may take to be in force (default 10)",
    )


def _source(args: argparse.Namespace) -> membership.Source:
    check_membership_flags(args)
    source = membership_source(
        args.namespace_sources,
        args.namespaces_from_discovery,
        args.endpoint_prefix,
        namespaces=args.namespace,
    )
    if source is not None:
        return source
    if args.namespace:
        return membership.DiscoverySource(args.namespace)
    raise ValueError(
        "choose the members: --namespace NS, --namespace-sources FILE or "
        "--namespaces-from-discovery"
    )


async def serve(args: argparse.Namespace, source: membership.Source) -> int:
    stop = asyncio.Event()
    on_stop_signals(stop)
    config = RelayConfig(
        nats_urls=tuple(u for u in args.nats.split(",") if u),
        stream=args.stream,
        max_age=args.max_age,
        max_bytes=args.max_bytes,
        buffer=args.buffer,
        creds=args.nats_creds,
    )
    relay = KvRelay(config)
    try:
        store = await open_store(args.store)
    except (StoreError, ValueError) as exc:
        print(f"shoal kv-relay: {exc}", file=sys.stderr)
        return 1
    watch = membership_watch(source, args.endpoint_prefix, args.setup_timeout)(Discovery(store))
    status = StatusServer(relay, watch)
    try:
        await relay.start()
        watch.subscribe(relay.on_view)
        await watch.start()
        relay.on_view(watch.view)
        if args.status_port is not None:
            await status.start(args.host, args.status_port)
        print_ready("kv-relay", status=status.url or "none")
        await stop.wait()
        return 0
    except (StoreError, OSError, membership.MembershipError) as exc:
        print(f"shoal kv-relay: {exc}", file=sys.stderr)
        return 1
    finally:
        await status.stop()
        await watch.stop()
        await relay.stop()
        await store.close()


def run(args: argparse.Namespace) -> int:
    try:
        source = _source(args)
    except ValueError as exc:
        print(f"shoal kv-relay: {exc}", file=sys.stderr)
        return 2
    return run_event_loop(serve(args, source))
