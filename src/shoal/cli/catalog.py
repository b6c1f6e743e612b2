"""`shoal catalog`: serve the catalog API, migrate its database, and apply, get or delete
resources through the API.

    shoal catalog serve [--db URL] [--port P] [--store URL]
                                                   the API (migrates first); with a discovery
                                                   store, the models controller too
    shoal catalog migrate [--db URL]               the schema only
    shoal catalog apply -f FILE [--prune]          make a file of resources true
    shoal catalog get KIND [NAME] [-o json|yaml|table]
    shoal catalog delete KIND NAME
    shoal catalog key create NAME [--models M,M] [--rpm N] [--tpm N] ...
                                                   a new API key: prints its secret, once
    shoal catalog key rotate NAME [--old-valid-for SECONDS]
                                                   a new secret; the old ones end then
    shoal catalog usage [--key K] [--model M] [--from T] [--to T] [--group-by key|model|minute]
                                                   requests and tokens of the API keys
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

from shoal.cli.common import (
    COUNT,
    PORT,
    SECONDS,
    add_flag,
    env_value,
    number,
    on_stop_signals,
    print_ready,
    run_event_loop,
)

DEFAULT_PORT = 8100
DEFAULT_INTERVAL = 2.0
DEFAULT_LEADER_TTL = 10.0
MAX_LOCAL_WORKERS = 64  # as `shoal.catalog.backends.MAX_LOCAL_WORKERS` (not imported: start-up)
COLUMNS: dict[str, tuple[str, ...]] = {
    "providers": ("type", "status", "base_url", "namespace", "auth_secret"),
    "models": ("base_model", "format", "context_length", "providers"),
    "virtual-models": ("default_model", "targets", "autoprovisioned"),
    "deployments": ("model", "engine", "replicas", "namespace", "status"),
    "keys": ("models", "rpm", "tpm", "max_parallel", "expires_at", "disabled"),
}
LIMIT = number(int, low=1)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "catalog",
        help="the catalog: providers, models, virtual models, deployments",
        description="Serve the catalog API, or apply, get and delete its resources.",
    )
    commands = parser.add_subparsers(dest="catalog_command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve the catalog API (migrates the database)")
    add_database_flag(serve)
    add_flag(serve, "--host", "127.0.0.1", help="listen address")
    add_flag(serve, "--port", DEFAULT_PORT, type=PORT, help=f"port (default {DEFAULT_PORT})")
    add_auth_flags(serve)
    add_key_pepper_flag(serve)
    add_flag(
        serve,
        "--public-read",
        action="store_true",
        help="reads need no admin token (SHOAL_PUBLIC_READ=1)",
    )
    add_controller_flags(serve)
    add_flag(
        serve,
        "--usage-retention-days",
        90.0,
        type=number(float, low=0, high=MAX_RETENTION_DAYS),
        help="days of API key usage kept: older rows, and the ids of batches received before, "
        "are deleted every hour (default 90, at most 36500; 0: kept for ever)",
    )

    migrate = commands.add_parser("migrate", help="bring the database schema up to date")
    add_database_flag(migrate)

    apply = commands.add_parser("apply", help="create or update the resources of a file")
    apply.add_argument("-f", "--file", required=True, help="YAML or JSON file ('-': stdin)")
    apply.add_argument("--prune", action="store_true", help="delete what the file no longer names")
    add_client_flags(apply)

    get = commands.add_parser("get", help="print resources of one kind")
    get.add_argument("kind", help="providers, models, virtual-models or deployments")
    get.add_argument("name", nargs="?", help="one resource (default: all)")
    get.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    add_client_flags(get)

    delete = commands.add_parser("delete", help="delete one resource")
    delete.add_argument("kind", help="providers, models, virtual-models or deployments")
    delete.add_argument("name")
    add_client_flags(delete)

    key = commands.add_parser("key", help="create an API key or rotate its secret")
    key_commands = key.add_subparsers(dest="key_command", required=True, metavar="COMMAND")
    create = key_commands.add_parser("create", help="a new key; prints its secret, once")
    create.add_argument("name")
    create.add_argument("--models", default="", help="comma-separated served names (default: all)")
    for flag, what in (
        ("--rpm", "requests per minute"),
        ("--tpm", "tokens per minute"),
        ("--max-parallel", "requests at once"),
    ):
        create.add_argument(flag, type=LIMIT, help=f"{what} (default: no limit)")
    create.add_argument("--expires-at", help="ISO 8601 time it stops working (default: never)")
    create.add_argument("--description", default="")
    add_client_flags(create)
    rotate = key_commands.add_parser("rotate", help="a new secret; prints it, once")
    rotate.add_argument("name")
    add_flag(
        rotate,
        "--old-valid-for",
        0.0,
        type=number(float, low=0),
        help="seconds the current secrets keep working (default 0: they stop at once)",
    )
    add_client_flags(rotate)

    usage = commands.add_parser("usage", help="requests and tokens of the API keys")
    usage.add_argument("--key", help="one key (default: all)")
    usage.add_argument("--model", help="one model (default: all)")
    usage.add_argument("--from", dest="start", help="ISO 8601 time, inclusive")
    usage.add_argument("--to", dest="end", help="ISO 8601 time, exclusive")
    usage.add_argument("--group-by", choices=("key", "model", "minute"), default="key")
    usage.add_argument("-o", "--output", choices=("table", "json"), default="table")
    add_client_flags(usage)


def add_database_flag(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--db",
        env="catalog_db",
        help="database URL: sqlite:///path or postgresql://user@host/db "
        "(default: catalog.db in the user state dir)",
    )


MAX_RETENTION_DAYS = 36_500.0  # a century: `--usage-retention-days` at most


def add_controller_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--store",
        help="discovery store URL: runs the models controller, which starts deployments and "
        "publishes routes there (SHOAL_STORE; default: no controller)",
    )
    add_flag(
        parser,
        "--controller-interval",
        DEFAULT_INTERVAL,
        type=SECONDS,
        help=f"seconds between two controller passes (default {DEFAULT_INTERVAL:g})",
    )
    add_flag(
        parser,
        "--leader-ttl",
        DEFAULT_LEADER_TTL,
        type=SECONDS,
        help="seconds of the controller's leadership lease: a replica takes over that long "
        f"after the leader is gone, and acts that long later (default {DEFAULT_LEADER_TTL:g})",
    )
    add_flag(
        parser,
        "--max-local-workers",
        MAX_LOCAL_WORKERS,
        type=COUNT,
        help="worker processes the controller starts at most on this host for all deployments: "
        "one asking more is in ERROR, the others run on "
        f"(SHOAL_MAX_LOCAL_WORKERS; default {MAX_LOCAL_WORKERS})",
    )


def add_auth_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--admin-token",
        help="bearer token the API requires (SHOAL_ADMIN_TOKEN; default: none)",
    )


def add_key_pepper_flag(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--key-pepper",
        "",
        help="hashed with every API key secret; the same on the catalog and the frontends "
        "that check keys (SHOAL_KEY_PEPPER; default: none)",
    )


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--url",
        f"http://127.0.0.1:{DEFAULT_PORT}",
        env="catalog_url",
        help=f"catalog API (SHOAL_CATALOG_URL; default http://127.0.0.1:{DEFAULT_PORT})",
    )
    add_flag(parser, "--workspace", "default", short="-w", help="workspace")
    add_auth_flags(parser)


def run(args: argparse.Namespace) -> int:
    command = args.catalog_command
    if args.log_level.upper() != "DEBUG":
        logging.getLogger("alembic").setLevel(logging.WARNING)  # one line per migration step
    if command == "serve":
        return run_event_loop(serve(args))
    if command == "migrate":
        return run_event_loop(migrate(args))
    if command == "apply":
        from shoal.catalog.apply import MAX_FILE_BYTES

        try:
            if args.file == "-":
                data = sys.stdin.buffer.read(MAX_FILE_BYTES + 1)
            else:
                with Path(args.file).open("rb") as file:
                    data = file.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            print(f"shoal catalog apply: {args.file}: {exc.strerror}", file=sys.stderr)
            return 1
        if len(data) > MAX_FILE_BYTES:
            print(f"shoal catalog apply: {args.file}: over {MAX_FILE_BYTES} bytes",
                  file=sys.stderr)  # fmt: skip
            return 1
        try:
            args.text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            print(f"shoal catalog apply: {args.file}: not UTF-8: {exc}", file=sys.stderr)
            return 1
    return run_event_loop(client_command(args))


async def serve(args: argparse.Namespace) -> int:
    from shoal.catalog import CatalogConfig, CatalogServer, default_database_url
    from shoal.urls import redact_url

    stop = asyncio.Event()
    on_stop_signals(stop)
    config = CatalogConfig(
        database_url=args.db or default_database_url(),
        host=args.host,
        port=args.port,
        admin_token=args.admin_token,
        public_read=args.public_read,
        key_pepper=args.key_pepper,
        usage_retention_days=args.usage_retention_days,
    )
    server = CatalogServer(config)
    try:
        await server.start()
    except Exception as exc:  # a database or socket error, reported in one line
        print(f"shoal catalog serve: {redact_url(config.database_url)}: {exc}", file=sys.stderr)
        await server.stop()
        return 1
    controller = None
    if args.store:
        controller = await start_controller(
            server,
            args.store,
            args.controller_interval,
            args.leader_ttl,
            own_process=True,
            max_local_workers=args.max_local_workers,
        )
        if controller is None:
            await server.stop()
            return 1
    print_ready("catalog", url=server.url, db=redact_url(config.database_url))
    await stop.wait()
    if controller is not None:
        await controller.stop()
    await server.stop()
    return 0


async def start_controller(
    server: Any,
    store_url: str,
    interval: float,
    leader_ttl: float = DEFAULT_LEADER_TTL,
    *,
    own_process: bool = False,
    max_local_workers: int = MAX_LOCAL_WORKERS,
) -> Any:
    """The models controller of `server`'s catalog, started on the store at `store_url`;
    `None` once the reason it cannot start is printed. Its workers log beside the store.
    `own_process`: the process is the catalog's (`catalog serve`), so the controller may set
    its garbage collector (`shoal.catalog.collector`); `shoal up` shares it with a frontend."""
    import platformdirs

    from shoal.catalog.controller import ControllerConfig, ModelsControllerService

    config = ControllerConfig(
        catalog_url=server.url,
        store_url=store_url,
        admin_token=server.config.admin_token,
        interval=interval,
        leader_ttl=leader_ttl,
        max_local_workers=max_local_workers,
        log_dir=Path(platformdirs.user_log_dir("shoal")) / "deployments",
        defer_full_collections=own_process,
    )
    controller = ModelsControllerService(config)
    try:
        await controller.start()
    except Exception as exc:  # the store is unreachable or its URL is wrong
        print(f"shoal catalog: the models controller cannot start: {exc}", file=sys.stderr)
        await controller.stop()
        return None
    server.controllers = controller.manager  # /health/controllers reports its loop
    return controller


async def migrate(args: argparse.Namespace) -> int:
    from shoal.catalog import default_database_url, open_engine
    from shoal.catalog import migrate as migrate_schema
    from shoal.catalog.database import current_revision
    from shoal.urls import redact_url

    url = args.db or default_database_url()
    engine = open_engine(url)
    try:
        await migrate_schema(engine)
        async with engine.connect() as conn:
            revision = await current_revision(conn)
    except Exception as exc:
        print(f"shoal catalog migrate: {redact_url(url)}: {exc}", file=sys.stderr)
        return 1
    finally:
        await engine.dispose()
    print(f"{redact_url(url)}: at revision {revision}")
    return 0


async def client_command(args: argparse.Namespace) -> int:
    import aiohttp

    from shoal.catalog import CatalogClient, CatalogError
    from shoal.urls import redact_url

    name = f"shoal catalog {args.catalog_command}"
    try:
        async with CatalogClient(args.url, token=args.admin_token, workspace=args.workspace) as c:
            if args.catalog_command == "apply":
                return await apply(c, args)
            if args.catalog_command == "get":
                return await get(c, args)
            if args.catalog_command == "key":
                return await key(c, args)
            if args.catalog_command == "usage":
                return await usage(c, args)
            return await delete(c, args)
    except CatalogError as exc:
        print(f"{name}: {exc.message}", file=sys.stderr)
    except (KeyError, ValueError) as exc:
        print(f"{name}: {exc.args[0] if exc.args else exc}", file=sys.stderr)
    except aiohttp.ClientError as exc:
        print(f"{name}: cannot reach the catalog at {redact_url(args.url)}: {exc}", file=sys.stderr)
    return 1


async def apply(client: Any, args: argparse.Namespace) -> int:
    from shoal.catalog.apply import ApplyError, apply_documents, parse_documents

    try:
        documents = parse_documents(
            args.text, workspace=args.workspace, json_only=args.file.endswith(".json")
        )
    except ApplyError as exc:  # the message names the file
        origin = "standard input" if args.file == "-" else args.file
        raise ApplyError(f"{origin}: {exc}") from None
    for change in await apply_documents(client, documents, prune=args.prune):
        print(change, flush=True)
    return 0


async def get(client: Any, args: argparse.Namespace) -> int:
    from shoal.catalog import kind_named

    kind = kind_named(args.kind)
    if args.name:
        items = [await client.get(kind, args.name)]
    else:
        items = []
        async for page in client.pages(kind):
            items += page.items
            for name, why in page.invalid.items():  # listed without it, named on stderr
                print(f"shoal catalog get: {kind.plural} {name}: cannot be read: {why}",
                      file=sys.stderr)  # fmt: skip
    rows = []
    for item in items:
        try:
            rows.append({"kind": kind.singular, **item.model_dump(mode="json")})
        except ValueError as exc:  # a row from before a bound (nested past what prints)
            print(f"shoal catalog get: {kind.plural} {item.name}: cannot be printed: {exc}",
                  file=sys.stderr)  # fmt: skip
    if args.output == "json":
        print(json.dumps(rows[0] if args.name else rows, indent=2))
    elif args.output == "yaml":
        import yaml

        print(yaml.safe_dump_all(rows, sort_keys=False), end="")
    else:
        print(table(rows, ("name", "version", *COLUMNS[kind.plural])))
    return 0


def table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, list):
            return ",".join(
                str(v.get("model_entity", v)) if isinstance(v, dict) else str(v) for v in value
            )
        return "" if value is None else str(value)

    cells = [[c.upper() for c in columns]] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in cells
    )


async def delete(client: Any, args: argparse.Namespace) -> int:
    from shoal.catalog import kind_named

    kind = kind_named(args.kind)
    await client.delete(kind, args.name)
    print(f"{kind.plural.rstrip('s')} {args.workspace}/{args.name} deleted")
    return 0


async def key(client: Any, args: argparse.Namespace) -> int:
    """`key create` / `key rotate`: the secret on stdout, alone on its line, and only there."""
    from datetime import UTC, datetime, timedelta

    if args.key_command == "create":
        fields: dict[str, Any] = {
            "models": [m.strip() for m in args.models.split(",") if m.strip()],
            "description": args.description,
        }
        for field in ("rpm", "tpm", "max_parallel", "expires_at"):
            if getattr(args, field) is not None:
                fields[field] = getattr(args, field)
        made = await client.create_key(args.name, fields)
    else:
        until = datetime.now(UTC) + timedelta(seconds=args.old_valid_for)
        made = await client.rotate_key(args.name, old_valid_until=until.isoformat())
    print(f"key {args.workspace}/{args.name} {args.key_command}d; its secret (shown once):")
    print(made.secret)
    return 0


async def usage(client: Any, args: argparse.Namespace) -> int:
    items = await client.usage(
        key=args.key, model=args.model, start=args.start, end=args.end, group_by=args.group_by
    )
    if args.output == "json":
        print(json.dumps(items, indent=2))
    else:
        columns = (args.group_by, "requests", "prompt_tokens", "completion_tokens", "total_tokens")
        print(table(items, columns))
    return 0


def add_catalog_port_flag(parser: argparse.ArgumentParser) -> None:
    """`--catalog-port` for `shoal up`, which runs the catalog beside the frontend."""
    add_flag(
        parser,
        "--catalog-port",
        DEFAULT_PORT,
        type=PORT,
        help=f"port of the catalog API on the embedded database (default {DEFAULT_PORT})",
    )


class EmbeddedCatalog:
    """The catalog API and its models controller as `shoal up` runs them: stopped together."""

    def __init__(self, server: Any, controller: Any) -> None:
        self.server, self.controller = server, controller

    @property
    def url(self) -> str:
        return str(self.server.url)

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.stop()
        await self.server.stop()


async def start_catalog(
    host: str, port: int, store_url: str | None = None, interval: float | None = None
) -> EmbeddedCatalog | None:
    """The catalog API on the default database, started, with its models controller on
    `store_url` if given; `None` once a warning is printed (`shoal up` serves models without
    it: the catalog is desired state, not the request path)."""
    from shoal.catalog import CatalogConfig, CatalogServer, default_database_url

    config = CatalogConfig(
        database_url=default_database_url(),
        host=host,
        port=port,
        key_pepper=env_value("key_pepper") or "",
    )
    server = CatalogServer(config)
    try:
        await server.start()
    except Exception as exc:  # a database or socket error, reported in one line
        print(f"shoal up: the catalog is not running: {exc}", file=sys.stderr)
        await server.stop()
        return None
    if interval is None:
        interval = float(env_value("controller_interval") or DEFAULT_INTERVAL)
    leader_ttl = float(env_value("leader_ttl") or DEFAULT_LEADER_TTL)
    most = int(env_value("max_local_workers") or MAX_LOCAL_WORKERS)
    controller = (
        await start_controller(server, store_url, interval, leader_ttl, max_local_workers=most)
        if store_url
        else None
    )
    return EmbeddedCatalog(server, controller)
