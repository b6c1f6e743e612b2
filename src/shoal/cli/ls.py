"""`shoal ls`: the models, instances and taints in a discovery store."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec

from shoal.cli.common import add_flag, run_event_loop, shown
from shoal.discovery import Discovery, Query
from shoal.store import StoreError, default_store_url, open_store
from shoal.urls import redact_url


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ls", help="list models, instances and taints in the store")
    add_flag(
        p,
        "--store",
        help="store URL (default: SHOAL_STORE or the embedded SQLite file)",
    )
    add_flag(p, "--namespace", help="only this namespace")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")


async def collect(store_url: str, namespace: str | None) -> dict[str, Any]:
    """What the store holds, as `shoal ls` shows it. URLs are shown without what may hold a
    secret (`redact_url`): a worker behind Basic auth registers `http://user:password@...`,
    and this output is pasted into tickets."""
    store = await open_store(store_url)
    try:
        disc = Discovery(store)
        query = Query(namespace)
        models = await disc.list(query)
        instances = await disc.list_instances(query)
    finally:
        await store.close()
    return {
        "store": redact_url(store_url),
        # values that are not a valid card or instance (written by hand, or by a newer or
        # broken worker): never served, counted and named here
        "skipped": [{"key": k, "reason": r} for k, r in sorted(disc.skipped.items())],
        "models": [
            {
                "model": m.card.display_name,
                "endpoint": str(m.key.endpoint),
                "instance": f"{m.key.instance_id:x}",
                "suffix": m.key.suffix,
                "role": str(m.card.role),
                "mdcsum": m.card.mdcsum,
                "taints": list(m.card.taints),
                "url": redact_url(m.url),
            }
            for m in models
        ],
        "instances": [
            {
                "endpoint": str(i.endpoint_id),
                "instance": f"{i.instance_id:x}",
                "url": redact_url(i.url),
                "status_url": redact_url(i.status_url),
            }
            for i in instances
        ],
    }


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[c.upper() for c in columns]] + [
        [
            shown(
                ", ".join(v)
                if isinstance(v := r[c], list)
                else ("-" if v in (None, "") else str(v))
            )
            for c in columns
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def run(args: argparse.Namespace) -> int:
    url = args.store or default_store_url()
    try:
        data = run_event_loop(collect(url, args.namespace))
    except (StoreError, ValueError) as exc:
        print(f"shoal ls: {exc}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(msgspec.json.encode(data).decode() + "\n")
        return 0
    print(f"store: {data['store']}\n")
    if data["models"]:
        print(
            table(
                data["models"], ["model", "endpoint", "instance", "suffix", "role", "taints", "url"]
            )
        )
    else:
        print("no models registered")
    print()
    if data["instances"]:
        print(table(data["instances"], ["endpoint", "instance", "url", "status_url"]))
    else:
        print("no endpoint instances registered")
    if data["skipped"]:
        print(f"\n{len(data['skipped'])} value(s) skipped, not a valid card or instance:")
        print(table(data["skipped"], ["key", "reason"]))
    return 0
