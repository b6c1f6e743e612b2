"""A frontend's registry in one process (not a test): memory per instance, and the cost of a
reconciliation pass that finds nothing changed, without the noise of other processes.

    .venv/bin/python -m bench.registry_memory [--instances 30000] [--models 3000]
        [--store sqlite:///tmp/fleet.db] [--tracemalloc [--frames N]] [--passes 5]
        [--stalls MS] [--profile FILE] [--profile-load FILE] [--trim]

The fleet is `bench.registry`'s (instance i serves `model-{i % models}`, two metadata files
per model); its metadata files are put in the frontend's cache directory first, so every
card joins without a download. A store that already holds the fleet (a SQLite file from an
earlier run) is not written again.

Reported: the load (wall and CPU time, the longest hold of the event loop and the garbage
collections meanwhile); the memory the frontend holds once every instance joined, over the
process before the frontend started, per instance (RSS; with `--trim` also after glibc's
`malloc_trim`, which shows what the C library kept of the memory the load freed; with
`--tracemalloc` the bytes Python allocated, with the lines, or the tracebacks of `--frames`,
that allocated most); then `--passes` reconciliation passes after the frontend's own first
one, each with its wall time, the CPU time of the event loop's thread and of the process
(the store's thread included), and the longest the event loop was held between two runs of
a 1 ms timer, in CPU time of its thread (what other processes take on a shared machine does
not count; garbage collections do; work done in slices that yield shows as up to three of
them: the timer runs after the slice that was running when it fell due, and the next one).
`--stalls MS` samples the event loop thread's stack while it runs over MS without yielding
(a watchdog thread; it needs the GIL, so a long C call shows in the frame after it).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import ctypes
import gc
import json
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
from collections import Counter
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
        self.gc_worst_generation = -1
        self.gc_total = 0.0
        self._gc_start = 0.0
        gc.callbacks.append(self._collected)
        self._task = asyncio.create_task(self._run())

    def _collected(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.thread_time()
            return
        self.gc_total += time.thread_time() - self._gc_start
        if time.thread_time() - self._gc_start > self.gc_worst:
            self.gc_worst = time.thread_time() - self._gc_start
            self.gc_worst_generation = info["generation"]

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


class StallSampler:
    """Where the event loop's thread spends a long hold: a watchdog thread reads that thread's
    CPU clock every 0.5 ms, and once it ran more than `threshold` s since the loop's 1 ms timer
    last ran, samples its stack (innermost `depth` frames of shoal's code). Load-independent:
    it counts the thread's CPU time, not the wall time other processes take."""

    def __init__(self, threshold: float, depth: int = 6) -> None:
        self.threshold, self.depth = threshold, depth
        self.samples: Counter[str] = Counter()
        self._thread_id = threading.get_ident()
        self._clock = time.pthread_getcpuclockid(self._thread_id)
        self._tick = time.clock_gettime(self._clock)
        self._stop = threading.Event()
        self._task = asyncio.create_task(self._ticks())
        self._watchdog = threading.Thread(target=self._watch, daemon=True)
        self._watchdog.start()

    async def _ticks(self) -> None:
        while True:
            self._tick = time.clock_gettime(self._clock)
            await asyncio.sleep(0.001)

    def _watch(self) -> None:
        while not self._stop.wait(0.0005):
            if time.clock_gettime(self._clock) - self._tick < self.threshold:
                continue
            frame = sys._current_frames().get(self._thread_id)
            if frame is None:
                continue
            stack = traceback.extract_stack(frame)
            ours = [f for f in stack if "/shoal/" in f.filename] or stack[-3:]
            where = " <- ".join(
                f"{f.filename.rsplit('/', 2)[-2:][-1]}:{f.lineno} {f.name}"
                if "/shoal/" not in f.filename
                else f"{f.filename.rsplit('/shoal/', 1)[1]}:{f.lineno} {f.name}"
                for f in reversed(ours[-self.depth :])
            )
            self.samples[where] += 1

    async def stop(self) -> Counter[str]:
        self._stop.set()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._watchdog.join()
        return self.samples


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


def report_stalls(when: str, samples: Counter[str], top: int = 8) -> None:
    print(f"stacks sampled in holds {when} (0.5 ms samples):")
    for where, count in samples.most_common(top):
        print(f"{count:6d}  {where}")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instances", type=int, default=30_000)
    parser.add_argument("--models", type=int, default=3000)
    parser.add_argument("--store", default="memory://bench")
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--frames", type=int, default=1, help="frames per allocation: >1 groups by traceback"
    )
    parser.add_argument("--profile", help="write a cProfile of the passes to this file")
    parser.add_argument("--profile-load", help="write a cProfile of the load to this file")
    parser.add_argument(
        "--trim", action="store_true", help="also the RSS after glibc's malloc_trim(0)"
    )
    parser.add_argument(
        "--stalls", type=float, default=0.0, metavar="MS",
        help="sample the stacks of the event loop holds longer than MS (CPU ms), at start and in passes",
    )  # fmt: skip
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
        tracemalloc.start(args.frames)
    traced0 = tracemalloc.get_traced_memory()[0]
    config = FrontendConfig(port=0, cache_dir=cache_dir, reconcile_interval=3600, setup_timeout=300)
    frontend = Frontend(config, discovery=discovery)
    t, cpu = time.perf_counter(), time.process_time()
    load_hold = LoopHold()
    sampler = StallSampler(args.stalls / 1e3) if args.stalls else None
    load_profile = cProfile.Profile() if args.profile_load else None
    if load_profile is not None:
        load_profile.enable()
    await frontend.start()
    while len(frontend.registry._members) < args.instances:  # noqa: ASYNC110 (no event)
        await asyncio.sleep(0.05)
    if load_profile is not None:
        load_profile.disable()
        load_profile.dump_stats(args.profile_load)
    res: dict[str, float] = {
        "load_s": time.perf_counter() - t,
        "load_cpu_s": time.process_time() - cpu,
        "load_hold_max_ms": await load_hold.stop() * 1e3,
        "load_gc_max_ms": load_hold.gc_worst * 1e3,
        "load_gc_max_generation": load_hold.gc_worst_generation,
        "load_gc_total_s": load_hold.gc_total,
    }
    if sampler is not None:
        report_stalls("while loading", await sampler.stop())
    await asyncio.sleep(1)
    gc.collect()
    res["rss_mib"] = rss_mib() - rss0
    if args.trim:  # what the C library keeps of the memory the load freed
        t = time.perf_counter()
        ctypes.CDLL(None).malloc_trim(0)
        res["trim_ms"] = (time.perf_counter() - t) * 1e3
        res["rss_trimmed_per_instance_b"] = (rss_mib() - rss0) * 2**20 / args.instances
    res["rss_per_instance_b"] = res["rss_mib"] * 2**20 / args.instances
    if args.tracemalloc:
        res["traced_mib"] = (tracemalloc.get_traced_memory()[0] - traced0) / 2**20
        res["traced_per_instance_b"] = res["traced_mib"] * 2**20 / args.instances
        by = "lineno" if args.frames == 1 else "traceback"
        top = tracemalloc.take_snapshot().statistics(by)[: args.top]
        tracemalloc.stop()
        for stat in top:
            where = "\n        <- ".join(str(frame) for frame in reversed(stat.traceback))
            print(f"{stat.size / args.instances:8.0f} B/instance  {where}")
    assert frontend.watcher is not None
    watcher = frontend.watcher
    # The frontend's own first pass (its reconciler steps at start) is over before ours run:
    # two passes at once list twice, and the second reads everything again.
    while not watcher.metrics.reconcile_runs._value.get() or watcher._epochs:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        counts[type(obj).__name__] = counts.get(type(obj).__name__, 0) + 1
    res["gc_tracked_per_instance"] = len(gc.get_objects()) / args.instances
    print("gc-tracked objects:", sorted(counts.items(), key=lambda kv: -kv[1])[:12])
    walls, cpus, process_cpus, holds, gcs = [], [], [], [], []
    gc_generations: list[int] = []
    sampler = StallSampler(args.stalls / 1e3) if args.stalls else None
    for _ in range(args.passes):
        probe = LoopHold()
        await asyncio.sleep(0.01)
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:
            profile.enable()
        t, cpu, process_cpu = time.perf_counter(), time.thread_time(), time.process_time()
        repairs = await frontend.watcher.reconcile()
        walls.append(time.perf_counter() - t)
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.profile)
        cpus.append(time.thread_time() - cpu)
        process_cpus.append(time.process_time() - process_cpu)
        holds.append(await probe.stop())
        gcs.append(probe.gc_worst)
        gc_generations.append(probe.gc_worst_generation)
        assert not repairs, repairs
    if sampler is not None:
        report_stalls("in the passes", await sampler.stop())
    res["pass_wall_ms"] = min(walls) * 1e3
    res["pass_cpu_ms"] = min(cpus) * 1e3
    res["pass_process_cpu_ms"] = min(process_cpus) * 1e3  # (with the store's thread)
    res["pass_hold_max_ms"] = max(holds) * 1e3
    res["pass_hold_median_ms"] = sorted(holds)[len(holds) // 2] * 1e3
    res["pass_gc_max_ms"] = max(gcs) * 1e3
    res["pass_gc_max_generation"] = gc_generations[gcs.index(max(gcs))]
    await frontend.stop()
    await store.close()
    print(json.dumps({k: round(v, 2) for k, v in res.items()}))


if __name__ == "__main__":
    asyncio.run(main())
