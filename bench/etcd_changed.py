"""etcd: a listing of what changed, from the history or from every key (not a test).

    .venv/bin/python -m bench.etcd_changed [--keys 100000] [--writes 0,10,100,1000] [--rounds 3]

A real etcd (Debian's etcd-server) on free loopback ports holds `--keys` keys of 400 bytes
under one prefix. For each count of `--writes` (overwrites of existing keys after the
reader's revision), `get_prefixes_changed` since that revision is timed twice, alternating:
with the history replayed (the default) and with it switched off (`HISTORY_REVISIONS = 0`:
every key without its value, then the values written since). Reported: wall time and this
process's CPU, best of `--rounds`, the items listed, and whether the answer was a delta.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time

from tests.etcd_server import EtcdServer

from shoal.store import etcd as etcd_module
from shoal.store import open_store

PREFIX = "shoal/v1/instances/bench/"


async def run(keys: int, writes: list[int], rounds: int) -> None:
    server = EtcdServer()
    server.start()
    try:
        store = await open_store(server.url)
        gate = asyncio.Semaphore(200)

        async def put(i: int, value: bytes) -> None:
            async with gate:
                await store.put(f"{PREFIX}{i:07d}", value)

        await asyncio.gather(*(put(i, b"x" * 400) for i in range(keys)))
        history = etcd_module.HISTORY_REVISIONS
        print("| writes since | path | wall (ms) | CPU (ms) | items | delta |")
        print("|---:|---|---:|---:|---:|---|")
        for n in writes:
            best: dict[str, tuple[float, float, int, bool]] = {}
            for _ in range(rounds):
                for path, limit in (("history", history), ("every key", 0)):
                    since = (await store.get_prefixes_changed((PREFIX,), 0)).revision
                    for i in range(n):
                        await store.put(f"{PREFIX}{i:07d}", b"y" * 400)
                    etcd_module.HISTORY_REVISIONS = limit
                    wall, cpu = time.perf_counter(), time.process_time()
                    listing = await store.get_prefixes_changed((PREFIX,), since)
                    wall = (time.perf_counter() - wall) * 1000
                    cpu = (time.process_time() - cpu) * 1000
                    etcd_module.HISTORY_REVISIONS = history
                    got = (wall, cpu, len(listing.items), listing.removed is not None)
                    if path not in best or wall < best[path][0]:
                        best[path] = got
            for path, (wall, cpu, items, delta) in best.items():
                print(f"| {n:,} | {path} | {wall:.1f} | {cpu:.1f} | {items:,} | {delta} |")
        await store.close()
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--writes", default="0,10,100,1000")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, python {platform.python_version()}, keys {args.keys:,}")
    asyncio.run(run(args.keys, [int(w) for w in args.writes.split(",")], args.rounds))


if __name__ == "__main__":
    main()
