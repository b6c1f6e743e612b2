"""Soak (not a test): churn under steady load, watching for leaks and failed requests.

    .venv/bin/python -m bench.soak                  # 30 minutes, figures for docs/reliability.md
    .venv/bin/python -m bench.soak --duration 60    # the short version the test suite runs
    .venv/bin/python -m bench.soak --kill-every 20  # streams while a worker is SIGKILLed every 20 s

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

`--kill-every SECONDS` runs the migration soak instead: one frontend, three mocker workers,
seeded streams only (each checked against the text of an undisturbed mocker), and every
SECONDS the oldest worker SIGKILLed and a new one started. Measured: streams sent,
truncated (an error mid-stream: the goal is 0), wrong text, migrations by outcome, and the
splice latency (the frontend's `shoal_frontend_migration_splice_seconds`, p99 as the
bound of its bucket; and the clients' longest gap between two chunks of a stream).
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
import openai

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
    return sum(int(ep["models_announced"]) for ep in health.get("endpoints", []))


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


STREAM_WORKER = ("--lease-ttl", f"{LEASE_TTL:g}", "--ttft-ms", "5", "--itl-ms", "10")
STREAM_TOKENS = 100


class KillSoak:
    """The migration soak (`--kill-every`); `run()` returns its figures."""

    def __init__(self, duration: float, kill_every: float, clients: int, tmp: Path) -> None:
        self.duration = duration
        self.kill_every = kill_every
        self.clients = clients
        self.tmp = tmp
        self.store = f"sqlite:///{tmp / 'store.db'}"
        self.processes = Processes(tmp)
        self.references: dict[int, str] = {}
        self.sent = self.ok = self.truncated = self.wrong = self.failed_before_first_byte = 0
        self.gaps: list[float] = []  # per stream, its longest gap between two chunks
        self.failures: list[str] = []
        self.kills = 0

    async def run(self) -> dict[str, Any]:
        from aiohttp.test_utils import TestClient, TestServer

        from shoal.worker.engines.mocker import MockerEngine

        engine = MockerEngine("mock-llm", speedup=0)
        await engine.start()
        client: TestClient[Any, Any] = TestClient(TestServer(engine.app()))
        await client.start_server()
        reference = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused")
        try:
            for key in range(50):
                answer = await reference.chat.completions.create(**self._request(key))
                self.references[key] = answer.choices[0].message.content or ""
            return await self._run()
        finally:
            await self.processes.close()
            await client.close()
            await engine.stop()

    def _request(self, key: int) -> dict[str, Any]:
        return {
            "model": "mock-llm",
            "messages": [{"role": "user", "content": f"Tell me story {key}."}],
            "seed": key,
            "temperature": 0,
            "max_tokens": STREAM_TOKENS,
        }

    async def _run(self) -> dict[str, Any]:
        workers = [await self.processes.worker(self.store, *STREAM_WORKER) for _ in range(3)]
        front = await self.processes.start(
            "frontend", "--store", self.store, "--port", "0", "--reconcile-interval", "5",
            "--first-byte-timeout", "5", "--cache-dir", str(self.tmp / "cache"),
            ready="frontend",
        )  # fmt: skip
        await wait_for(lambda: _at_least(front, 3), timeout=30, message="workers routed")
        stop = asyncio.Event()
        api = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0)
        loops = [asyncio.create_task(self._loop(api, n, stop)) for n in range(self.clients)]
        started = time.monotonic()
        try:
            while time.monotonic() - started < self.duration:
                await asyncio.sleep(min(self.kill_every, self.duration))
                if time.monotonic() - started >= self.duration:
                    break
                oldest = workers.pop(0)
                oldest.signal(signal.SIGKILL)
                self.kills += 1
                await oldest.wait(30)
                workers.append(await self.processes.worker(self.store, *STREAM_WORKER))
        finally:
            stop.set()
            await asyncio.gather(*loops)
            await api.close()
        metrics = await _metrics_text(front.url)
        return {
            "duration_s": self.duration,
            "kill_every_s": self.kill_every,
            "workers_killed": self.kills,
            "streams_sent": self.sent,
            "streams_ok": self.ok,
            "truncated": self.truncated,
            "wrong_text": self.wrong,
            "failed_before_first_byte": self.failed_before_first_byte,
            "failures": self.failures[:5],
            "migrations": _samples(metrics, "shoal_frontend_migrations_total"),
            "splice_p99_s_bucket": _histogram_quantile(
                metrics, "shoal_frontend_migration_splice_seconds", 0.99
            ),
            "splice_count": sum(
                _samples(metrics, "shoal_frontend_migration_splice_seconds_count").values()
            ),
            "client_gap_p50_s": _quantile(self.gaps, 0.5),
            "client_gap_p99_s": _quantile(self.gaps, 0.99),
            "client_gap_max_s": max(self.gaps, default=0.0),
        }

    async def _loop(self, api: openai.AsyncOpenAI, n: int, stop: asyncio.Event) -> None:
        i = n
        while not stop.is_set():
            key = i % 50
            i += self.clients
            self.sent += 1
            text, received, gap = "", 0, 0.0
            last = time.perf_counter()
            try:
                stream = await api.chat.completions.create(**self._request(key), stream=True)
                async for chunk in stream:
                    now = time.perf_counter()
                    if received:
                        gap = max(gap, now - last)
                    last = now
                    received += 1
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
            except openai.APIError as exc:
                self.failures.append(repr(exc))
                if received:
                    self.truncated += 1
                else:
                    self.failed_before_first_byte += 1
                continue
            self.gaps.append(gap)
            if text == self.references[key]:
                self.ok += 1
            else:
                self.wrong += 1


async def _metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        return await response.text()


def _samples(text: str, name: str) -> dict[str, float]:
    """The samples of metric `name` in a Prometheus text, by their label set."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line[len(name) :].rpartition(" ")
            out[labels.strip() or "-"] = float(value)
    return out


def _histogram_quantile(text: str, name: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile `q` of histogram `name`, or None."""
    buckets = []
    for labels, value in _samples(text, name + "_bucket").items():
        bound = labels.split('le="', 1)[1].split('"', 1)[0]
        buckets.append((float(bound), value))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= q * total)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 4)


def kill_markdown(figures: dict[str, Any], command: str) -> str:
    migrations = figures["migrations"]
    attempted = sum(v for k, v in migrations.items() if 'outcome="attempted"' in k)
    refused = sum(v for k, v in migrations.items() if 'outcome="refused"' in k)
    return (
        f"| {figures['duration_s']:g} s of seeded streams ({STREAM_TOKENS} tokens), a worker "
        f"of 3 SIGKILLed every {figures['kill_every_s']:g} s ({figures['workers_killed']} kills) "
        f"| {figures['streams_sent']} | {figures['truncated']} | {figures['wrong_text']} | "
        f"{attempted:g} migrated, {refused:g} refused | "
        f"p99 ≤ {figures['splice_p99_s_bucket']} s (gateway), a stream's longest gap between chunks "
        f"p50 {figures['client_gap_p50_s']} s, p99 {figures['client_gap_p99_s']} s, max {round(figures['client_gap_max_s'], 3)} s | "
        f"`{command}` |"
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800, help="seconds (default 1800)")
    parser.add_argument("--churn-seconds", type=float, default=3, help="seconds between churns")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown row")
    parser.add_argument(
        "--kill-every",
        type=float,
        default=0,
        help="the migration soak: SIGKILL a worker every this many seconds (0: the churn soak)",
    )
    args = parser.parse_args()
    command = "python -m bench.soak " + " ".join(sys.argv[1:])
    if args.kill_every > 0:
        with tempfile.TemporaryDirectory(prefix="shoal-soak-") as tmp:
            soak = KillSoak(args.duration, args.kill_every, args.clients, Path(tmp))
            figures = await soak.run()
        print(json.dumps(figures, indent=2))
        if args.markdown:
            print(kill_markdown(figures, command))
        return 0
    with tempfile.TemporaryDirectory(prefix="shoal-soak-") as tmp:
        figures = await Soak(args.duration, args.churn_seconds, args.clients, Path(tmp)).run()
    figures["growth"] = growth(figures)
    print(json.dumps(figures, indent=2))
    if args.markdown:
        print(markdown(figures, "python -m bench.soak " + " ".join(sys.argv[1:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
