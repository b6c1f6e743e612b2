"""`Store.put_many` against one `put` per key (not a test): the time to put N leased keys on
a SQLite store, and what a watch in another process received meanwhile.

    .venv/bin/python -m bench.put_many --keys 20000
    .venv/bin/python -m bench.put_many --keys 20000 --pace 0   # put_many unpaced

A worker re-putting its cards after a lost lease (300-byte values here). The watcher, a
child process, lists the prefix, watches from the next revision and counts the `Put`s and
`Resync`s it gets until it holds every key. `--pace` sets `PUT_MANY_PACE` (seconds between
two transactions of one put_many) in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shoal.store import open_store
from shoal.store import sqlite as sqlite_module

WATCHER = """
import asyncio, sys
from shoal.store import Put, Resync, open_store

async def main(url, keys):
    store = await open_store(url)
    snap = await store.get_prefix("bench/")
    print("ready", flush=True)
    held, puts, resyncs = set(), 0, 0
    async for event in store.watch("bench/", snap.revision + 1):
        if isinstance(event, Resync):
            resyncs += 1
            held = {kv.key for kv in event.items}
        elif isinstance(event, Put):
            puts += 1
            held.add(event.key)
        if len(held) == keys:
            break
    await store.close()
    print(puts, resyncs, flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def run(keys: int, mode: str) -> None:
    with tempfile.TemporaryDirectory(prefix="shoal-put-many-") as tmp:
        url = f"sqlite://{tmp}/store.db"
        store = await open_store(url)
        watcher = await asyncio.create_subprocess_exec(
            sys.executable, "-c", WATCHER, url, str(keys), stdout=asyncio.subprocess.PIPE
        )
        try:
            assert watcher.stdout is not None
            await watcher.stdout.readline()
            lease = await store.grant(60)
            items = [(f"bench/{i:06d}", b"x" * 300) for i in range(keys)]
            started = time.perf_counter()
            if mode == "put":
                for key, value in items:
                    await store.put(key, value, lease=lease.id)
            else:
                await store.put_many(items, lease=lease.id)
            took = time.perf_counter() - started
            out, _ = await asyncio.wait_for(watcher.communicate(), 120)
            puts, resyncs = map(int, out.split())
            print(
                f"{mode:8} {keys:,} keys in {took:5.2f} s;"
                f" the other process's watch got {puts:,} Puts, {resyncs} Resyncs",
                flush=True,
            )
        finally:
            if watcher.returncode is None:
                watcher.kill()
            await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--pace", type=float, default=sqlite_module.PUT_MANY_PACE)
    args = ap.parse_args()
    sqlite_module.PUT_MANY_PACE = args.pace
    for mode in ("put", "put_many"):
        asyncio.run(run(args.keys, mode))


if __name__ == "__main__":
    main()
