"""The reports a frontend gives of a large fleet: `/health`, `/ui/api/snapshot`, `/ui/api/events`
(not a test).

    .venv/bin/python -m bench.fleet_reports [--instances 100000] [--models 10000] \
        [--seconds 5] [--every 0.1] TREE [TREE ...]

For each TREE (its `src` on `PYTHONPATH`), a frontend process of its own (`--serve`) starts
over an empty SQLite store and joins `--instances` synthetic instances of `--models` models
straight into its registry (the reports read only the registry and the watcher; 1 % of the
instances tainted `draining`, 1 % inhibited as after a failure), then frozen out of the
garbage collector as `shoal frontend`'s first load is. Then, each for `--seconds`,
with `../shared/tools/stall_probe.py`-style probes of `/live` every 5 ms from a process of
their own:

- idle: nothing else asked;
- health: `GET /health` asked every `--every` s (0.1; back to back if answers take longer);
- snapshot: `GET /ui/api/snapshot` likewise;
- page: one `/ui/api/events` stream open (a dashboard page), its events read.

Reported per phase: the longest `/live` answer, its p99, and for the asked route its body's
bytes and answer time (p50). Stalls longer than 20 ms break the frontend's rule.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.cold_start import Probe, free_port
from shoal.cards import ModelCard, slugify
from shoal.discovery import InstanceInfo, ModelInstance, ModelKey
from shoal.frontend import Frontend, FrontendConfig

ROOT = Path(__file__).resolve().parent.parent


async def serve(instances: int, models: int, work: Path) -> None:
    """The frontend's process: start, join the synthetic fleet, print the URL, run until EOF."""
    frontend = Frontend(
        FrontendConfig(
            store_url=f"sqlite:///{work}/store.db",
            port=free_port(),
            cache_dir=work / "cache",
            reconcile_interval=3600,
        )
    )
    await frontend.start()
    cards = [
        ModelCard.build(
            display_name=f"model-{m}",
            slug=slugify(f"model-{m}"),
            source=f"bench://model-{m}",
            model_types=["chat", "completions"],
            context_length=8192,
        )
        for m in range(models)
    ]
    registry = frontend.registry
    for i in range(instances):
        iid = 0x10000 + i
        info = InstanceInfo("bench", "backend", "generate", iid, "http://127.0.0.1:9/v1", "")
        card = cards[i % models]
        if i % 100 == 1:
            card = card.with_taints(("draining",))
        registry.join(ModelInstance(ModelKey(info.endpoint_id, iid), card, info))
        if i % 100 == 2:
            registry.member(ModelKey(info.endpoint_id, iid)).upstream.inhibit(3600)  # type: ignore[union-attr]
        if i % 2000 == 0:
            await asyncio.sleep(0)
    gc.freeze()  # as `shoal frontend`'s first load leaves it (registry/freeze.py)
    print(frontend.url, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await frontend.stop()


async def ask(
    session: aiohttp.ClientSession, url: str, seconds: float, every: float
) -> dict[str, Any]:
    """`url` asked for `seconds`, a request every `every` s (or back to back when an answer
    takes longer): answers, body bytes, p50 and max answer time."""
    times: list[float] = []
    size = 0
    end = time.monotonic() + seconds
    while (start := time.monotonic()) < end:
        if times:
            await asyncio.sleep(max(0.0, every - times[-1]))
            start = time.monotonic()
        async with session.get(url) as response:
            body = await response.read()
            assert response.status == 200, (response.status, body[:200])
        times.append(time.monotonic() - start)
        size = len(body)
    return {
        "answers": len(times),
        "bytes": size,
        "p50_ms": round(1000 * statistics.median(times), 1),
        "max_ms": round(1000 * max(times), 1),
    }


async def page(session: aiohttp.ClientSession, url: str, seconds: float) -> dict[str, Any]:
    """One event stream open for `seconds`: events and bytes read, the first snapshot's time."""
    start = time.monotonic()
    events = 0
    size = 0
    first = None
    async with session.get(url) as response:
        assert response.status == 200, response.status
        end = start + seconds
        tail = b""
        while (left := end - time.monotonic()) > 0:
            try:
                chunk = await asyncio.wait_for(response.content.readany(), left)
            except TimeoutError:
                break
            if not chunk:
                break
            size += len(chunk)
            seen = (tail + chunk).count(b"\nevent: ") + (size == len(chunk))
            if seen and first is None:
                first = time.monotonic() - start
            events += seen
            tail = chunk[-8:]
    return {
        "events": events,
        "bytes": size,
        "first_event_ms": None if first is None else round(1000 * first, 1),
    }


async def phase(name: str, url: str, seconds: float, every: float) -> dict[str, Any]:
    probe = Probe(f"{url}/live")
    probe.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            if name == "idle":
                await asyncio.sleep(seconds)
                asked: dict[str, Any] = {}
            elif name == "health":
                asked = await ask(session, f"{url}/health", seconds, every)
            elif name == "snapshot":
                asked = await ask(session, f"{url}/ui/api/snapshot", seconds, every)
            else:
                asked = await page(session, f"{url}/ui/api/events", seconds)
    finally:
        probe.stop()
    return {"phase": name, "live": probe.report(), **asked}


async def bench_tree(tree: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-reports-"))
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}:{ROOT}"}
    command = [sys.executable, "-m", "bench.fleet_reports", "--serve", str(work)]
    command += ["--instances", str(args.instances), "--models", str(args.models)]
    server = subprocess.Popen(  # noqa: ASYNC220 (started once, read from a thread)
        command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert server.stdout is not None and server.stdin is not None
    try:
        url = (await asyncio.to_thread(server.stdout.readline)).decode().strip()
        if not url:
            raise SystemExit(f"{tree}: the frontend did not start")
        results = []
        for name in ("idle", "health", "snapshot", "page"):
            results.append(await phase(name, url, args.seconds, args.every))
            print(f"{tree.name}: {json.dumps(results[-1])}", flush=True)
        return results
    finally:
        server.stdin.close()
        server.wait(30)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instances", type=int, default=100_000)
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--every", type=float, default=0.1, help="seconds between two asks")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("trees", nargs="*", type=Path)
    args = parser.parse_args()
    if args.serve is not None:
        await serve(args.instances, args.models, args.serve)
        return
    print(f"command: python -m bench.fleet_reports {' '.join(sys.argv[1:])}")
    for tree in args.trees or [ROOT]:
        await bench_tree(tree.resolve(), args)


if __name__ == "__main__":
    asyncio.run(main())
