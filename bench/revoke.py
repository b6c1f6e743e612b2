"""How long revoking a lease that holds many keys takes on a store (SQLite by default): the
keys put under one lease with `put_many`, then `revoke` timed (on SQLite it holds the file's
write lock that long: every other writer waits). Prints the seconds of each run.

    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.revoke [--keys 20000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from shoal.store import open_store


async def run(keys: int, url: str | None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        store = await open_store(url or f"sqlite:///{tmp}/store.db")
        try:
            prefix = f"bench-revoke/{time.monotonic_ns()}/"
            lease = await store.grant(120, keepalive=False)
            await store.put_many(
                [(f"{prefix}{i:06d}", b"x" * 200) for i in range(keys)], lease=lease.id
            )
            started = time.perf_counter()
            await store.revoke(lease.id)
            took = time.perf_counter() - started
            left = (await store.get_prefix(prefix)).items
            assert not left, f"{len(left)} keys left after the revoke"
            return took
        finally:
            await store.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, default=20_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--store", help="a store URL (default: a new SQLite file)")
    args = p.parse_args()
    took = [asyncio.run(run(args.keys, args.store)) for _ in range(args.runs)]
    print(f"revoke of {args.keys} keys: " + ", ".join(f"{t:.3f}" for t in took) + " s")


if __name__ == "__main__":
    main()
