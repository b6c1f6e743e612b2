"""A child process for the contract suite: `python -m tests.store.holder URL ACTION ...`.

- `lease KEY TTL`: grant a lease, put KEY under it, print `ready <lease id>`, keep it alive.
- `create KEY VALUE START_AT`: wait until wall time START_AT, create KEY, print `won` or `lost`.
- `put-many PREFIX COUNT BYTES`: grant a lease, print `ready`, wait for a line on stdin, put
  COUNT keys of BYTES bytes under PREFIX with one `put_many`, print `done <seconds>`.
"""

from __future__ import annotations

import asyncio
import sys
import time

from shoal.store import open_store


async def main(url: str, action: str, *args: str) -> None:
    store = await open_store(url)
    if action == "lease":
        key, ttl = args[0], float(args[1])
        lease = await store.grant(ttl)
        await store.put(key, b"held", lease=lease.id)
        print(f"ready {lease.id}", flush=True)
        await asyncio.Event().wait()
    elif action == "create":
        key, value, start_at = args[0], args[1], float(args[2])
        # every contender starts at `start_at`: the race under test
        await asyncio.sleep(max(0.0, start_at - time.time()))
        won = await store.create(key, value.encode())
        print("won" if won else "lost", flush=True)
    elif action == "put-many":
        prefix, count, size = args[0], int(args[1]), int(args[2])
        lease = await store.grant(60)
        items = [(f"{prefix}{i:06d}", b"x" * size) for i in range(count)]
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        started = time.perf_counter()
        await store.put_many(items, lease=lease.id)
        print(f"done {time.perf_counter() - started:.3f}", flush=True)
    await store.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
