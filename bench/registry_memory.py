"""A frontend's registry in one process (not a test): memory per instance, and the cost of a
reconciliation pass that finds nothing changed, without the noise of other processes.

    .venv/bin/python -m bench.registry_memory [--instances 30000] [--models 3000]
        [--store sqlite:///tmp/fleet.db] [--tracemalloc] [--passes 5]

The fleet is `bench.registry`'s (instance i serves `model-{i % models}`, two metadata files
per model); its metadata files are put in the frontend's cache directory first, so every
card joins without a download. A store that already holds the fleet (a SQLite file from an
earlier run) is not written again.

Reported: the memory the frontend holds once every instance joined, over the process before
the frontend started, per instance (RSS, and with `--tracemalloc` the bytes Python
allocated, with the lines that allocated most); then `--passes` reconciliation passes, each
with its wall time, the CPU time of the event loop's thread, and the longest the event loop
was held between two runs of a 1 ms timer, in CPU time of its thread (what other processes
take on a shared machine does not count; garbage collections do).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

from bench.registry import ENDPOINT, FILES, FIRST_ID, card_for, checksum, metadata_file
from shoal.discovery import Discovery, InstanceInfo, ModelKey
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.registry.metadata import MetadataCache
from shoal.store import open_store

WORKERS = [f"http://127.0.0.1:{9000 + w}" for w in range(3)]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class LoopHold:
    """The longest CPU time of the event loop's thread between two runs of a 1 ms timer."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.gc_worst = 0.0  # the longest garbage collection meanwhile (CPU time)
        self._gc_start = 0.0
        gc.callbacks.append(self._collected)
        self._task = asyncio.create_task(self._run())

    def _collected(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.thread_time()
        else:
            self.gc_worst = max(self.gc_worst, time.thread_time() - self._gc_start)

    async def _run(self) -> None:
        while True:
            t0 = time.thread_time()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.thread_time() - t0)

    async def stop(self) -> float:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        gc.callbacks.remove(self._collected)
        return self.worst


async def register(discovery: Discovery, n: int, models: int) -> None:
    async def one(i: int) -> None:
        iid = FIRST_ID + i
        url = WORKERS[i % len(WORKERS)]
        info = InstanceInfo(ENDPOINT.namespace, ENDPOINT.component, ENDPOINT.endpoint, iid,
                            url, url)  # fmt: skip
        await discovery.register_instance(info, lease=0)
        card = card_for(f"model-{i % models:04d}", "http://127.0.0.1:9", iid)
        await discovery.register_model(ModelKey(ENDPOINT, iid), card, lease=0)

    for start in range(0, n, 200):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 200))))


def fill_cache(directory: Path, models: int) -> None:
    """Put every model's metadata files in the cache, so that every card joins at once."""
    cache = MetadataCache(directory)
    for m in range(models):
        for name in FILES:
            data = metadata_file(f"model-{m:04d}", name)
            cache.path(checksum(data)).write_bytes(data)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instances", type=int, default=30_000)
    parser.add_argument("--models", type=int, default=3000)
    parser.add_argument("--store", default="memory://bench")
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--profile", help="write a cProfile of the passes to this file")
    args = parser.parse_args()

    store = await open_store(args.store)
    discovery = Discovery(store)
    held = len((await store.get_prefix("shoal/v1/instances/")).items)
    if held != args.instances:
        if held:
            raise SystemExit(f"{args.store} holds {held} instances, not {args.instances}")
        t = time.perf_counter()
        await register(discovery, args.instances, args.models)
        print(f"registered {args.instances} in {time.perf_counter() - t:.1f}s")
    cache_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-memory-"))
    fill_cache(cache_dir, args.models)
    discovery = Discovery(store)  # (no listing of the registration kept)
    gc.collect()
    rss0 = rss_mib()
    if args.tracemalloc:
        tracemalloc.start(1)
    traced0 = tracemalloc.get_traced_memory()[0]
    config = FrontendConfig(port=0, cache_dir=cache_dir, reconcile_interval=3600, setup_timeout=300)
    frontend = Frontend(config, discovery=discovery)
    t, cpu = time.perf_counter(), time.process_time()
    await frontend.start()
    while len(frontend.registry._members) < args.instances:  # noqa: ASYNC110 (no event)
        await asyncio.sleep(0.05)
    res: dict[str, float] = {
        "load_s": time.perf_counter() - t,
        "load_cpu_s": time.process_time() - cpu,
    }
    await asyncio.sleep(1)
    gc.collect()
    res["rss_mib"] = rss_mib() - rss0
    res["rss_per_instance_b"] = res["rss_mib"] * 2**20 / args.instances
    if args.tracemalloc:
        res["traced_mib"] = (tracemalloc.get_traced_memory()[0] - traced0) / 2**20
        res["traced_per_instance_b"] = res["traced_mib"] * 2**20 / args.instances
        top = tracemalloc.take_snapshot().statistics("lineno")[: args.top]
        tracemalloc.stop()
        for stat in top:
            print(f"{stat.size / args.instances:8.0f} B/instance  {stat.traceback}")
    assert frontend.watcher is not None
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        counts[type(obj).__name__] = counts.get(type(obj).__name__, 0) + 1
    res["gc_tracked_per_instance"] = len(gc.get_objects()) / args.instances
    print("gc-tracked objects:", sorted(counts.items(), key=lambda kv: -kv[1])[:12])
    walls, cpus, holds, gcs = [], [], [], []
    for _ in range(args.passes):
        probe = LoopHold()
        await asyncio.sleep(0.01)
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:
            profile.enable()
        t, cpu = time.perf_counter(), time.thread_time()
        repairs = await frontend.watcher.reconcile()
        walls.append(time.perf_counter() - t)
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.profile)
        cpus.append(time.thread_time() - cpu)
        holds.append(await probe.stop())
        gcs.append(probe.gc_worst)
        assert not repairs, repairs
    res["pass_wall_ms"] = min(walls) * 1e3
    res["pass_cpu_ms"] = min(cpus) * 1e3
    res["pass_hold_max_ms"] = max(holds) * 1e3
    res["pass_hold_median_ms"] = sorted(holds)[len(holds) // 2] * 1e3
    res["pass_gc_max_ms"] = max(gcs) * 1e3
    await frontend.stop()
    await store.close()
    print(json.dumps({k: round(v, 2) for k, v in res.items()}))


if __name__ == "__main__":
    asyncio.run(main())
