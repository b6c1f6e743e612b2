"""etcd: a listing of what changed, from the history or from every key (not a test).

    .venv/bin/python -m bench.etcd_changed [--keys 100000] [--writes 0,10,100,1000] [--rounds 3]

A real etcd (Debian's etcd-server) on free loopback ports holds `--keys` keys of 400 bytes
under one prefix. For each count of `--writes` (overwrites of existing keys after the
reader's revision), `get_prefixes_changed` since that revision is timed twice, alternating:
with the history replayed (the default) and with it switched off (`HISTORY_REVISIONS = 0`:
every key without its value, then the values written since). Reported: wall time and this
process's CPU, best of `--rounds`, the items listed, and whether the answer was a delta.

Then a watch of two prefixes (the keys', and an empty one: discovery watches instances and
cards as one) whose stream breaks: `--writes` land while it is away, and the time from its
reconnecting to its last event is timed, with the history replayed and with it off (a
`Resync`: every key read again).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time

from tests.etcd_server import EtcdServer

from shoal.store import Resync, etcd_watch, open_store
from shoal.store.etcd import EtcdStore

PREFIX = "shoal/v1/instances/bench/"


async def run(keys: int, writes: list[int], rounds: int) -> None:
    server = EtcdServer()
    server.start()
    try:
        store = await open_store(server.url)
        assert isinstance(store, EtcdStore)
        gate = asyncio.Semaphore(200)

        async def put(i: int, value: bytes) -> None:
            async with gate:
                await store.put(f"{PREFIX}{i:07d}", value)

        await asyncio.gather(*(put(i, b"x" * 400) for i in range(keys)))
        history = etcd_watch.HISTORY_REVISIONS
        print("| writes since | path | wall (ms) | CPU (ms) | items | delta |")
        print("|---:|---|---:|---:|---:|---|")
        for n in writes:
            best: dict[str, tuple[float, float, int, bool]] = {}
            for _ in range(rounds):
                for path, limit in (("history", history), ("every key", 0)):
                    since = (await store.get_prefixes_changed((PREFIX,), 0)).revision
                    for i in range(n):
                        await store.put(f"{PREFIX}{i:07d}", b"y" * 400)
                    etcd_watch.HISTORY_REVISIONS = limit
                    wall, cpu = time.perf_counter(), time.process_time()
                    listing = await store.get_prefixes_changed((PREFIX,), since)
                    wall = (time.perf_counter() - wall) * 1000
                    cpu = (time.process_time() - cpu) * 1000
                    etcd_watch.HISTORY_REVISIONS = history
                    got = (wall, cpu, len(listing.items), listing.removed is not None)
                    if path not in best or wall < best[path][0]:
                        best[path] = got
            for path, (wall, cpu, items, delta) in best.items():
                print(f"| {n:,} | {path} | {wall:.1f} | {cpu:.1f} | {items:,} | {delta} |")
        print()
        print("| writes while the watch was away | catch-up | wall (ms) | CPU (ms) | resynced |")
        print("|---:|---|---:|---:|---|")
        for n in writes:
            caught: dict[str, tuple[float, float, bool]] = {}
            for _ in range(rounds):
                for path, limit in (("history", history), ("every key", 0)):
                    etcd_watch.HISTORY_REVISIONS = limit
                    timed = await broken_watch(store, n)
                    etcd_watch.HISTORY_REVISIONS = history
                    if path not in caught or timed[0] < caught[path][0]:
                        caught[path] = timed
            for path, (wall, cpu, resynced) in caught.items():
                print(f"| {n:,} | {path} | {wall:.1f} | {cpu:.1f} | {resynced} |")
        await store.close()
    finally:
        server.stop()


async def broken_watch(store: EtcdStore, writes: int) -> tuple[float, float, bool]:
    """A watch of two prefixes, broken while `writes` land: its catch-up's wall and CPU."""
    since = (await store.get_prefixes_changed((PREFIX,), 0)).revision
    back, done = asyncio.Event(), asyncio.Event()
    pause = store._pause
    target = since + max(writes, 1)
    resynced = False

    async def held(delay: float) -> None:
        await back.wait()
        await pause(0)

    async def follow() -> None:
        nonlocal resynced
        async for event in store.watch_prefixes((PREFIX, "shoal/v1/models/bench/"), since + 1):
            resynced = resynced or isinstance(event, Resync)
            if event.revision >= target:
                done.set()

    store._pause = held  # type: ignore[method-assign]
    watching = asyncio.create_task(follow())
    try:
        while not store._watch_calls:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        for call in list(store._watch_calls):
            call.cancel()
        while store._watch_calls:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        for i in range(writes):
            await store.put(f"{PREFIX}{i:07d}", b"z" * 400)
        if not writes:
            await store.put(f"{PREFIX}{0:07d}", b"z" * 400)
        wall, cpu = time.perf_counter(), time.process_time()
        back.set()
        await asyncio.wait_for(done.wait(), 60)
        wall = (time.perf_counter() - wall) * 1000
        cpu = (time.process_time() - cpu) * 1000
    finally:
        store._pause = pause  # type: ignore[method-assign]
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    return wall, cpu, resynced


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
