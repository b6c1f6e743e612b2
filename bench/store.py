"""Store benchmark (not a test): puts/s, watch latency, and list_and_watch of 10,000 instances.

    .venv/bin/python -m bench.store [--backends memory,sqlite,etcd] [--puts 2000] [--instances 10000]

etcd: a real server is started on free loopback ports (Debian's etcd-server must be installed).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import tempfile
import time
import uuid

from tests.etcd_server import EtcdServer

from shoal.cards import ModelCard
from shoal.discovery import Added, Discovery, EndpointId, InstanceInfo, ModelKey
from shoal.store import Put, open_store


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def bench_puts(url: str, n: int) -> float:
    store = await open_store(url)
    prefix = f"bench/{uuid.uuid4().hex[:8]}/"
    value = b"x" * 512
    start = time.perf_counter()
    for i in range(n):
        await store.put(f"{prefix}{i}", value)
    elapsed = time.perf_counter() - start
    await store.close()
    return n / elapsed


async def bench_watch_latency(url: str, n: int) -> tuple[float, float]:
    writer = await open_store(url)
    watcher = await open_store(url)
    prefix = f"bench/{uuid.uuid4().hex[:8]}/"
    snap = await watcher.get_prefix(prefix)
    sent: dict[str, float] = {}
    latencies: list[float] = []
    done = asyncio.Event()

    async def watch() -> None:
        async for ev in watcher.watch(prefix, snap.revision + 1):
            if isinstance(ev, Put) and ev.key in sent:
                latencies.append(time.perf_counter() - sent[ev.key])
                if len(latencies) == n:
                    done.set()
                    return

    task = asyncio.create_task(watch())
    await writer.put(prefix + "warmup", b"")
    for i in range(n):
        key = f"{prefix}{i}"
        sent[key] = time.perf_counter()
        await writer.put(key, b"v")
        await asyncio.sleep(0.005)
    await asyncio.wait_for(done.wait(), 30)
    task.cancel()
    await writer.close()
    await watcher.close()
    return pct(latencies, 0.5) * 1000, pct(latencies, 0.99) * 1000


async def bench_list_and_watch(url: str, n: int) -> tuple[float, float]:
    store = await open_store(url)
    disc = Discovery(store)
    ns = f"b{uuid.uuid4().hex[:8]}"
    cards = [
        ModelCard.build(
            display_name=f"model-{m}",
            slug=f"model-{m}",
            source="hf://x",
            model_types=["chat"],
            context_length=4096,
        )
        for m in range(1000)
    ]
    start = time.perf_counter()
    for i in range(n):
        ep = EndpointId(ns, "backend", "generate")
        iid = 0x1000 + i
        await disc.register_instance(
            InstanceInfo(ns, "backend", "generate", iid, f"http://127.0.0.1:{i}", "http://s"),
            lease=0,
        )
        await disc.register_model(ModelKey(ep, iid), cards[i % len(cards)], lease=0)
    register_s = time.perf_counter() - start
    reader = await open_store(url)
    start = time.perf_counter()
    seen = 0
    async for ev in Discovery(reader).list_and_watch():
        if isinstance(ev, Added) and ev.model.key.endpoint.namespace == ns:
            seen += 1
            if seen == n:
                break
    elapsed = time.perf_counter() - start
    await reader.close()
    await store.close()
    return register_s, elapsed


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="memory,sqlite,etcd")
    parser.add_argument("--puts", type=int, default=2000)
    parser.add_argument("--watch-events", type=int, default=500)
    parser.add_argument("--instances", type=int, default=10_000)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}"
    )
    print("| backend | puts/s | watch p50 ms | watch p99 ms | register N s | list_and_watch N s |")
    print("|---|---|---|---|---|---|")
    for backend in args.backends.split(","):
        server = None
        if backend == "memory":
            url = f"memory://{uuid.uuid4().hex}"
        elif backend == "sqlite":
            url = f"sqlite:///{tempfile.mkdtemp()}/bench.db"
        else:
            server = EtcdServer()
            server.start()
            url = server.url
        try:
            puts = await bench_puts(url, args.puts)
            p50, p99 = await bench_watch_latency(url, args.watch_events)
            reg, law = await bench_list_and_watch(url, args.instances)
            print(f"| {backend} | {puts:,.0f} | {p50:.1f} | {p99:.1f} | {reg:.1f} | {law:.2f} |")
        finally:
            if server is not None:
                server.close()


if __name__ == "__main__":
    asyncio.run(main())
