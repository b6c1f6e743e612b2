"""Soak (not a test): churn under steady load, watching for leaks and failed requests.

    .venv/bin/python -m bench.soak                  # 30 minutes, figures for docs/reliability.md
    .venv/bin/python -m bench.soak --duration 60    # the short version the test suite runs

On one SQLite store: two frontends, two long-lived mocker workers, and for the whole run:
official `openai` clients sending chat completions (streaming and not) to both frontends
(a refused connection is retried at the other, as behind a load balancer); a churn worker
started every `--churn-seconds` and the oldest one stopped (SIGTERM and SIGKILL in turn);
a LoRA adapter attached to a long-lived worker and the previous one detached on each churn
tick; one frontend restarted half-way.

Measured: RSS and open file descriptors of the frontend that is not restarted and of the
long-lived workers, after the warm-up (the first quarter) and at the end; the frontend's
registry (instances) and the workers' model lists before the churn and after it settles;
requests sent and failed. Prints JSON, and a markdown row with `--markdown`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.faults.support import LEASE_TTL, Load
from tests.helpers import free_port, wait_for
from tests.processes import Process, Processes

WORKER = ("--lease-ttl", f"{LEASE_TTL:g}", "--ttft-ms", "5", "--itl-ms", "2")


def footprint(pid: int) -> dict[str, int]:
    """Resident memory (KiB) and open file descriptors of one process."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.json()


async def registry_size(front: Process) -> int:
    health = await get_json(f"{front.url}/health")
    return int(health.get("instances", 0))


async def _at_least(front: Process, instances: int) -> bool:
    return await registry_size(front) >= instances


async def models_of(worker: Process) -> int:
    health = await get_json(f"{worker.status_url}/health")
    return sum(len(ep["models"]) for ep in health.get("endpoints", []))


class Soak:
    """One soak run; `run()` returns its figures."""

    def __init__(self, duration: float, churn_seconds: float, clients: int, tmp: Path) -> None:
        self.duration = duration
        self.churn_seconds = churn_seconds
        self.clients = clients
        self.tmp = tmp
        self.store = f"sqlite:///{tmp / 'store.db'}"
        self.processes = Processes(tmp)
        self.churned: list[Process] = []
        self.started_churn = 0
        self.adapters = 0

    async def frontend(self, port: int) -> Process:
        return await self.processes.start(
            "frontend", "--store", self.store, "--port", str(port), "--reconcile-interval", "5",
            "--first-byte-timeout", "5", "--cache-dir", str(self.tmp / f"cache-{port}"),
            ready="frontend",
        )  # fmt: skip

    async def worker(self) -> Process:
        return await self.processes.worker(self.store, *WORKER)

    async def churn(self, long_lived: Process) -> None:
        """Start a worker, stop the oldest churned one, swap an adapter on `long_lived`."""
        self.churned.append(await self.worker())
        self.started_churn += 1
        if len(self.churned) > 2:
            oldest = self.churned.pop(0)
            oldest.signal(signal.SIGKILL if self.started_churn % 2 else signal.SIGTERM)
            await oldest.wait(30)
        async with aiohttp.ClientSession() as session:
            name = f"soak-adapter-{self.adapters}"
            async with session.post(
                f"{long_lived.status_url}/v1/loras", json={"name": name, "path": f"/soak/{name}"}
            ) as response:
                assert response.status == 200, await response.text()
            if self.adapters:
                previous = f"soak-adapter-{self.adapters - 1}"
                async with session.delete(f"{long_lived.status_url}/v1/loras/{previous}") as r:
                    assert r.status == 200, await r.text()
            self.adapters += 1

    async def settle(self, long_lived: list[Process], fronts: list[Process]) -> None:
        """Stop the churn workers and adapters, then wait for the fleet to forget them."""
        for process in self.churned:
            process.signal(signal.SIGTERM)
            await process.wait(30)
        self.churned = []
        if self.adapters:
            async with aiohttp.ClientSession() as session:
                url = f"{long_lived[0].status_url}/v1/loras/soak-adapter-{self.adapters - 1}"
                async with session.delete(url) as response:
                    assert response.status == 200, await response.text()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sizes = [await registry_size(f) for f in fronts]
            if all(size == len(long_lived) for size in sizes):
                return
            await asyncio.sleep(0.2)

    async def run(self) -> dict[str, Any]:
        try:
            return await self._run()
        finally:
            await self.processes.close()

    async def _run(self) -> dict[str, Any]:
        long_lived = [await self.worker(), await self.worker()]
        port = free_port()
        restarted, steady = await self.frontend(port), await self.frontend(free_port())
        fronts = [restarted, steady]
        for front in fronts:
            await wait_for(lambda f=front: _at_least(f, 2), timeout=30, message="workers routed")
        baseline_models = [await models_of(w) for w in long_lived]
        baseline_registry = await registry_size(steady)
        watched = {"frontend": steady, "worker-0": long_lived[0], "worker-1": long_lived[1]}
        load = Load([restarted.url, steady.url], clients=self.clients)
        load.start()
        started = time.monotonic()
        warm: dict[str, dict[str, int]] = {}
        peak: dict[str, dict[str, int]] = {}
        restarted_once = False
        try:
            while (elapsed := time.monotonic() - started) < self.duration:
                await self.churn(long_lived[0])
                if not warm and elapsed >= self.duration / 4:
                    warm = {name: footprint(p.proc.pid) for name, p in watched.items()}
                for name, process in watched.items():
                    now = footprint(process.proc.pid)
                    top = peak.setdefault(name, now)
                    peak[name] = {k: max(top[k], now[k]) for k in now}
                if not restarted_once and elapsed >= self.duration / 2:
                    restarted.signal(signal.SIGTERM)
                    await restarted.wait(30)
                    fronts[0] = restarted = await self.frontend(port)
                    restarted_once = True
                await asyncio.sleep(self.churn_seconds)
            end = {name: footprint(p.proc.pid) for name, p in watched.items()}
        finally:
            await load.finish()
        await self.settle(long_lived, fronts)
        return {
            "duration_s": self.duration,
            "requests_sent": load.sent,
            "requests_ok": load.ok,
            "failed_before_first_byte": len(load.failed_before_first_byte),
            "failed_mid_stream": len(load.failed_mid_stream),
            "failures": (load.failed_before_first_byte + load.failed_mid_stream)[:5],
            "workers_churned": self.started_churn,
            "adapters_swapped": self.adapters,
            "after_warmup": warm,
            "peak": peak,
            "end": end,
            "registry_baseline": baseline_registry,
            "registry_after": await registry_size(steady),
            "worker_models_baseline": baseline_models,
            "worker_models_after": [await models_of(w) for w in long_lived],
        }


def growth(figures: dict[str, Any]) -> dict[str, dict[str, float]]:
    """End over after-warm-up, per watched process and measure (1.0: no growth)."""
    warm, end = figures["after_warmup"], figures["end"]
    return {
        name: {k: round(end[name][k] / max(warm[name][k], 1), 3) for k in warm[name]}
        for name in warm
    }


def markdown(figures: dict[str, Any], command: str) -> str:
    g = growth(figures)
    worst_rss = max(v["rss_kib"] for v in g.values())
    worst_fds = max(v["fds"] for v in g.values())
    return (
        f"| soak {figures['duration_s']:g} s: {figures['workers_churned']} workers churned, "
        f"{figures['adapters_swapped']} adapters swapped, a frontend restarted | sqlite | "
        f"{figures['requests_sent']} | {figures['failed_before_first_byte']} "
        f"(+{figures['failed_mid_stream']} cut mid-stream by SIGKILL) | "
        f"RSS x{worst_rss}, fds x{worst_fds} (end / after warm-up, worst process) | "
        f"registry {figures['registry_baseline']} → {figures['registry_after']} | `{command}` |"
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800, help="seconds (default 1800)")
    parser.add_argument("--churn-seconds", type=float, default=3, help="seconds between churns")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown row")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shoal-soak-") as tmp:
        figures = await Soak(args.duration, args.churn_seconds, args.clients, Path(tmp)).run()
    figures["growth"] = growth(figures)
    print(json.dumps(figures, indent=2))
    if args.markdown:
        print(markdown(figures, "python -m bench.soak " + " ".join(sys.argv[1:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
