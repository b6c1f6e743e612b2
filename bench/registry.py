"""Registry benchmark (not a test): a `shoal frontend` over 10,000 instances of 1,000 models.

    .venv/bin/python -m bench.registry [--backends sqlite,etcd] [--instances 10000] [--models 1000]

Per backend, a store (a SQLite file, or a real etcd server on loopback), a few real
`shoal worker --engine mocker --speedup 0` processes (models `mock-0`...), and one small
aiohttp server (a subprocess) hosting the synthetic metadata files: a worker's status server
hosts only the files of the models it attached, so it cannot serve synthetic ones. Then
`--instances` synthetic endpoint instances (namespace `bench`, lease 0) are registered with
their cards: instance i serves `model-{i % models}`, its request URL is one of the workers'
(so requests are really routed and forwarded), its card's two metadata files are distinct
per model (instances of a model share their checksums) at a URL distinct per instance.

Measured against a `shoal frontend` subprocess (its RSS and CPU read from /proc):

- cold start: from spawning the frontend (empty metadata cache) to all models in `/v1/models`,
  to all instances routable (`shoal_frontend_live_instances`), and to every metadata file
  written to the cache (`/health`: cards join before their files are on disk; the idle CPU
  is measured after the writes);
- a new registration routable: register a new instance and model (new metadata files), poll
  `GET /v1/models/{name}` until listed, then send a chat request and check that the frontend
  routed it to the new instance (`x-shoal-instance`; the mocker answers 404 for a name it
  does not serve, which is the worker's answer, after routing);
- `/v1/models` latency with every model loaded, and RSS;
- reconciliation: a second frontend with `--reconcile-interval 1` (warm cache). Pass wall
  time from its `shoal_frontend_reconcile_duration_seconds` histogram; CPU per pass from the
  process CPU while idle, minus the idle CPU of the first frontend (interval 3600 s);
  chat completion latency (to the workers' own models, sequential) on both frontends.

The machine is shared: before each frontend the bench waits (up to `--quiet-wait` s) for
other processes to use under 20% of a core, and reports the CPU they used during each run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from tests.etcd_server import EtcdServer

from shoal.cards import ModelCard, slugify
from shoal.cli.common import parse_ready_line, print_ready
from shoal.discovery import Discovery, EndpointId, InstanceInfo, ModelKey
from shoal.store import Store, open_store

NAMESPACE = "bench"
ENDPOINT = EndpointId(NAMESPACE, "backend", "generate")
FIRST_ID = 0x100000
FILES = ("config.json", "tokenizer_config.json")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# -- synthetic metadata files ----------------------------------------------------------------


def metadata_file(model: str, name: str) -> bytes:
    """The content of one synthetic metadata file: distinct per model, about 2 KB."""
    body = {"model": model, "file": name, "vocab": [f"{model}-tok{i}" for i in range(100)]}
    return json.dumps(body).encode()


def checksum(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def instance_info(instance_id: int, worker: dict[str, str]) -> InstanceInfo:
    """A synthetic endpoint instance whose requests go to `worker`."""
    ep = ENDPOINT
    return InstanceInfo(
        ep.namespace, ep.component, ep.endpoint, instance_id, worker["url"], worker["status"]
    )


def card_for(model: str, metadata_url: str, instance_id: int) -> ModelCard:
    files = {}
    for name in FILES:
        data = metadata_file(model, name)
        files[name] = {
            "url": f"{metadata_url}/meta/{instance_id:x}/{model}/{name}",
            "checksum": checksum(data),
            "size": len(data),
        }
    return ModelCard.build(
        display_name=model,
        slug=slugify(model),
        source=f"bench://{model}",
        model_types=["chat", "completions"],
        context_length=8192,
        metadata_files=files,
    )


def metadata_app() -> web.Application:
    """What the metadata server serves: `GET /meta/{instance}/{model}/{file}`."""

    async def get(request: web.Request) -> web.Response:
        info = request.match_info
        if info["file"] not in FILES:
            raise web.HTTPNotFound()
        return web.Response(body=metadata_file(info["model"], info["file"]))

    app = web.Application()
    app.router.add_get("/meta/{instance}/{model}/{file}", get)
    return app


async def serve_metadata() -> None:
    """The metadata server subprocess (`metadata_app`)."""
    runner = web.AppRunner(metadata_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print_ready("bench-metadata", url=f"http://127.0.0.1:{runner.addresses[0][1]}")
    await asyncio.Event().wait()


# -- processes -------------------------------------------------------------------------------


@dataclass
class Child:
    proc: asyncio.subprocess.Process
    ready: dict[str, str] = field(default_factory=dict)
    started: float = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def spawn(args: list[str], component: str, log: Path, timeout: float = 60) -> Child:
    """Start `python ARGS` and wait for its ready line (`shoal COMPONENT ready: ...`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("SHOAL_STORE", None)
    started = time.perf_counter()
    with log.open("ab") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, stdout=asyncio.subprocess.PIPE, stderr=err, env=env
        )
    child = Child(proc, started=started)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), deadline - time.monotonic())
        if not line:
            raise RuntimeError(f"{args[:3]} exited before it was ready; see {log}")
        if (ready := parse_ready_line(line.decode(), component)) is not None:
            child.ready = ready
            return child


async def start_frontend(
    store_url: str, cache: Path, interval: float, log: Path, *extra: str
) -> Child:
    args = ["-m", "shoal.cli.main", "frontend", "--store", store_url, "--port", "0"]
    args += ["--cache-dir", str(cache), "--reconcile-interval", str(interval), *extra]
    if profile := os.environ.get("SHOAL_BENCH_PROFILE"):
        # cProfile of the frontend, written when it exits (`python -m pstats FILE`).
        args = ["-m", "cProfile", "-o", f"{profile}.{interval:g}", *args]
    # A frontend prints its ready line once its fleet is loaded: minutes at 100,000 instances
    # on a busy machine.
    return await spawn(args, "frontend", log, timeout=900)


# -- measurements ----------------------------------------------------------------------------


async def register_fleet(
    disc: Discovery, n: int, models: int, workers: list[dict[str, str]], metadata_url: str
) -> None:
    async def one(i: int) -> None:
        iid = FIRST_ID + i
        worker = workers[i % len(workers)]
        info = instance_info(iid, worker)
        await disc.register_instance(info, lease=0)
        card = card_for(f"model-{i % models:04d}", metadata_url, iid)
        await disc.register_model(ModelKey(ENDPOINT, iid), card, lease=0)

    batch = 200
    for start in range(0, n, batch):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + batch))))


async def served_models(http: aiohttp.ClientSession, url: str) -> list[str]:
    async with http.get(f"{url}/v1/models") as resp:
        body = await resp.json()
    return [m["id"] for m in body["data"]]


async def wait_all_served(http: aiohttp.ClientSession, url: str, models: int) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        ids = await served_models(http, url)
        if sum(1 for m in ids if m.startswith("model-")) >= models:
            return
        await asyncio.sleep(0.02)
    raise RuntimeError("not every model was served within 300 s")


async def live_instances(http: aiohttp.ClientSession, url: str) -> int:
    """Instances routable now, by `/metrics` (`shoal_frontend_live_instances`)."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        int(float(line.rpartition(" ")[2]))
        for line in text.splitlines()
        if line.startswith('shoal_frontend_live_instances{model="model-')
    )


async def wait_all_joined(http: aiohttp.ClientSession, url: str, instances: int) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if await live_instances(http, url) >= instances:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("not every instance was routable within 300 s")


async def wait_files_written(http: aiohttp.ClientSession, url: str) -> None:
    """Until the metadata files the frontend verified are all on disk (`/health`): a card
    joins before its files are written, and the writes go on after a cold start."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        async with http.get(f"{url}/health") as resp:
            health = await resp.json()
        if health["metadata_cache"].get("unwritten_files", 0) == 0:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the metadata files were not written within 900 s")


async def models_latency(http: aiohttp.ClientSession, url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        async with http.get(f"{url}/v1/models") as resp:
            await resp.read()
            assert resp.status == 200
        out.append(time.perf_counter() - t)
    return out


async def chat_latency(
    http: aiohttp.ClientSession, url: str, models: list[str], seconds: float
) -> list[float]:
    """Sequential non-streaming chat completions for `seconds`, cycling over `models`."""
    out = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        body = {
            "model": models[i % len(models)],
            "messages": [{"role": "user", "content": f"hello {i}"}],
            "max_tokens": 8,
        }
        i += 1
        t = time.perf_counter()
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            await resp.read()
            assert resp.status == 200, resp.status
        out.append(time.perf_counter() - t)
    return out


async def registration_latency(
    disc: Discovery,
    http: aiohttp.ClientSession,
    url: str,
    workers: list[dict[str, str]],
    metadata_url: str,
    tries: int,
    tag: str,
) -> tuple[list[float], list[float]]:
    """Per try: seconds from the first put to listed, and to a request routed to it."""
    listed: list[float] = []
    routed: list[float] = []
    for k in range(tries):
        iid = FIRST_ID - 1 - k
        model = f"fresh-{tag}-{k}"
        worker = workers[k % len(workers)]
        info = instance_info(iid, worker)
        key = ModelKey(ENDPOINT, iid)
        card = card_for(model, metadata_url, iid)
        t0 = time.perf_counter()
        await disc.register_instance(info, lease=0)
        await disc.register_model(key, card, lease=0)
        deadline = t0 + 30
        while True:
            async with http.get(f"{url}/v1/models/{model}") as resp:
                await resp.read()
                if resp.status == 200:
                    break
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{model} not listed within 30 s")
            await asyncio.sleep(0.002)
        listed.append(time.perf_counter() - t0)
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            await resp.read()
            # The mocker does not serve this name: it answers 404 itself, after routing.
            if resp.headers.get("x-shoal-instance") != f"{iid:x}":
                raise RuntimeError(f"{model}: not routed to {iid:x} ({resp.status})")
        routed.append(time.perf_counter() - t0)
        await disc.unregister_model(key)
        await disc.unregister_instance(ENDPOINT, iid)
        # A random pause: a fixed one would lock the tries to the phase of SQLite's 50 ms poll.
        await asyncio.sleep(0.1 + random.random() * 0.1)
    return listed, routed


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("shoal_frontend_reconcile"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def histogram_max(metrics: dict[str, float], name: str) -> float:
    """The upper bound of the highest non-empty bucket of histogram `name`."""
    previous = 0.0
    bound = 0.0
    buckets = sorted(
        (float(m.group(1)), v)
        for k, v in metrics.items()
        if (m := re.match(rf'{name}_bucket{{le="([^"]+)"}}', k)) and m.group(1) != "+Inf"
    )
    for le, count in buckets:
        if count > previous:
            bound = le
        previous = count
    return bound


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (all cores), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


def process_cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Foreign:
    """CPU used by processes outside this benchmark (another benchmark, a build) in a window."""

    def __init__(self, ours: list[int]) -> None:
        self.ours = ours
        self._last: dict[int, float] = {}  # kept for processes that exited since

    def sample(self) -> tuple[float, float, float]:
        for pid in self.ours:
            self._last[pid] = max(self._last.get(pid, 0.0), process_cpu_seconds(pid))
        return time.monotonic(), machine_busy_seconds(), sum(self._last.values())

    def since(self, start: tuple[float, float, float]) -> float:
        """Cores used by other processes since `start`, on average."""
        now = self.sample()
        return max(0.0, (now[1] - start[1]) - (now[2] - start[2])) / (now[0] - start[0])

    async def wait_for_quiet(self, max_wait: float, threshold: float = 0.2) -> float:
        """Wait (up to `max_wait` s) for other processes to use under `threshold` of a core."""
        began = time.monotonic()
        while time.monotonic() - began < max_wait:
            start = self.sample()
            await asyncio.sleep(1.0)
            if self.since(start) < threshold:
                break
        return time.monotonic() - began


async def idle_cpu(child: Child, seconds: float) -> float:
    """CPU seconds per second the frontend used while no request was sent."""
    cpu0, t0 = child.cpu_seconds(), time.perf_counter()
    await asyncio.sleep(seconds)
    return (child.cpu_seconds() - cpu0) / (time.perf_counter() - t0)


# -- one backend -----------------------------------------------------------------------------


async def bench_backend(backend: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"instances": args.instances}
    server: EtcdServer | None = None
    children: list[Child] = []
    store: Store | None = None
    if backend == "sqlite":
        url = f"sqlite:///{work}/{backend}.db"
    elif backend == "etcd":
        server = EtcdServer()
        server.start()
        url = server.url
    else:
        raise SystemExit(f"unknown backend {backend!r}")
    log = work / f"{backend}.log"
    try:
        meta = await spawn(["-m", "bench.registry", "--serve-metadata"], "bench-metadata", log)
        children.append(meta)
        metadata_url = meta.ready["url"]
        workers: list[dict[str, str]] = []
        mock_models = [f"mock-{w}" for w in range(args.workers)]
        for name in mock_models:
            w = await spawn(
                ["-m", "shoal.cli.main", "worker", "--engine", "mocker", "--speedup", "0",
                 "--model", name, "--store", url],
                "worker", log,
            )  # fmt: skip
            children.append(w)
            workers.append(w.ready)

        store = await open_store(url)
        disc = Discovery(store)
        t = time.perf_counter()
        await register_fleet(disc, args.instances, args.models, workers, metadata_url)
        res["setup_s"] = time.perf_counter() - t

        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            # Frontend A: no reconciliation after the first pass; empty metadata cache.
            cache = work / f"cache-{backend}"
            ours = [os.getpid(), *(c.pid for c in children)]
            if server is not None and server.proc is not None:
                ours.append(server.proc.pid)
            foreign = Foreign(ours)
            # The empty frontend (a namespace nobody registered in): what RSS is counted over.
            empty = await start_frontend(
                url, work / "cache-empty", 3600, log, "--namespace", "none"
            )
            await asyncio.sleep(1)
            res["empty_rss_mib"] = empty.rss_mib()
            await empty.stop()
            res["quiet_wait_s"] = await foreign.wait_for_quiet(args.quiet_wait)
            fa = await start_frontend(url, cache, 3600, log)
            children.append(fa)
            ours.append(fa.pid)
            window = foreign.sample()
            res["ready_s"] = time.perf_counter() - fa.started
            await wait_all_served(http, fa.ready["url"], args.models)
            res["cold_start_s"] = time.perf_counter() - fa.started
            await wait_all_joined(http, fa.ready["url"], args.instances)
            res["all_joined_s"] = time.perf_counter() - fa.started
            # The frontend's own CPU: a busy machine moves it less than the wall time.
            res["cold_cpu_s"] = fa.cpu_seconds()
            res["rss_mib"] = fa.rss_mib()
            await wait_files_written(http, fa.ready["url"])
            res["files_written_s"] = time.perf_counter() - fa.started
            await asyncio.sleep(2)
            res["idle_cpu"] = await idle_cpu(fa, args.idle_seconds)
            lat = await models_latency(http, fa.ready["url"], args.models_requests)
            res["models_p50_ms"], res["models_p99_ms"] = pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3
            lat = await chat_latency(http, fa.ready["url"], mock_models, args.chat_seconds)
            res["chat_n"] = len(lat)
            res["chat_p50_ms"], res["chat_p99_ms"] = pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3
            res["chat_max_ms"] = max(lat) * 1e3
            listed, routed = await registration_latency(
                disc, http, fa.ready["url"], workers, metadata_url, args.tries, backend
            )
            res["listed_p50_ms"], res["listed_max_ms"] = pct(listed, 0.5) * 1e3, max(listed) * 1e3
            res["routed_p50_ms"], res["routed_max_ms"] = pct(routed, 0.5) * 1e3, max(routed) * 1e3
            res["rss_after_mib"] = fa.rss_mib()
            res["foreign_a"] = foreign.since(window)
            await fa.stop()
            res["quiet_wait_s"] += await foreign.wait_for_quiet(args.quiet_wait)

            # Frontend B: a reconciliation pass every second; warm metadata cache.
            fb = await start_frontend(url, cache, 1, log)
            children.append(fb)
            ours.append(fb.pid)
            window = foreign.sample()
            await wait_all_served(http, fb.ready["url"], args.models)
            res["warm_start_s"] = time.perf_counter() - fb.started
            await wait_all_joined(http, fb.ready["url"], args.instances)
            await asyncio.sleep(2)
            before = await scrape(http, fb.ready["url"])
            res["idle_cpu_reconciling"] = await idle_cpu(fb, args.idle_seconds)
            after = await scrape(http, fb.ready["url"])
            passes = (
                after["shoal_frontend_reconcile_duration_seconds_count"]
                - before["shoal_frontend_reconcile_duration_seconds_count"]
            )
            res["cpu_per_pass_ms"] = (  # (no pass ended in the window: a pass is that slow)
                (res["idle_cpu_reconciling"] - res["idle_cpu"]) * args.idle_seconds / passes * 1e3
                if passes
                else float("nan")
            )
            lat = await chat_latency(http, fb.ready["url"], mock_models, args.chat_seconds)
            res["rchat_n"] = len(lat)
            res["rchat_p50_ms"], res["rchat_p99_ms"] = pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3
            res["rchat_max_ms"] = max(lat) * 1e3
            lat = await models_latency(http, fb.ready["url"], args.models_requests)
            res["rmodels_p50_ms"], res["rmodels_p99_ms"] = pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3
            m = await scrape(http, fb.ready["url"])
            name = "shoal_frontend_reconcile_duration_seconds"
            res["passes"] = m[f"{name}_count"]
            res["pass_mean_ms"] = m[f"{name}_sum"] / m[f"{name}_count"] * 1e3
            res["pass_max_ms"] = histogram_max(m, name) * 1e3
            res["foreign_b"] = foreign.since(window)
            await fb.stop()
    finally:
        if store is not None:
            await store.close()
        for child in reversed(children):
            with contextlib.suppress(Exception):
                await child.stop()
        if server is not None:
            server.close()
    return res


ROWS: list[tuple[str, str, str]] = [
    ("setup: register N instances (concurrent, s)", "", "{setup_s:.1f}"),
    ("frontend ready line (s)", "", "{ready_s:.2f}"),
    ("cold start to all models in /v1/models (s)", "", "{cold_start_s:.2f}"),
    ("cold start to all N instances routable (s)", "< 10", "{all_joined_s:.2f}"),
    ("cold start to every metadata file on disk (s)", "", "{files_written_s:.2f}"),
    ("cold start CPU of the frontend, to all routable (s)", "", "{cold_cpu_s:.2f}"),
    ("warm start (metadata cached) to all models (s)", "", "{warm_start_s:.2f}"),
    ("new registration listed p50 / max (ms)", "", "{listed_p50_ms:.0f} / {listed_max_ms:.0f}"),
    ("new registration routed p50 / max (ms)", "< 100", "{routed_p50_ms:.0f} / {routed_max_ms:.0f}"),
    ("/v1/models p50 / p99 (ms)", "< 5", "{models_p50_ms:.2f} / {models_p99_ms:.2f}"),
    ("/v1/models p50 / p99, reconciling every 1 s (ms)", "< 5", "{rmodels_p50_ms:.2f} / {rmodels_p99_ms:.2f}"),
    ("frontend RSS after load / after tries (MiB)", "", "{rss_mib:.0f} / {rss_after_mib:.0f}"),
    ("frontend RSS with no instance (MiB)", "", "{empty_rss_mib:.0f}"),
    ("RSS per instance over the empty frontend (KB)", "≤ 5", "{rss_per_instance_kb:.1f}"),
    ("reconciliation pass wall mean / max bucket (ms)", "< 300", "{pass_mean_ms:.0f} / ≤{pass_max_ms:.0f}"),
    ("reconciliation pass CPU (ms)", "", "{cpu_per_pass_ms:.0f}"),
    ("idle CPU, interval 3600 s / 1 s (%)", "", "{idle_cpu_pct:.1f} / {idle_cpu_reconciling_pct:.1f}"),
    ("chat p50 / p99 / max, interval 3600 s (ms)", "", "{chat_p50_ms:.2f} / {chat_p99_ms:.2f} / {chat_max_ms:.1f}"),
    ("chat p50 / p99 / max, interval 1 s (ms)", "same", "{rchat_p50_ms:.2f} / {rchat_p99_ms:.2f} / {rchat_max_ms:.1f}"),
    ("chat requests answered in the window, interval 3600 s / 1 s", "", "{chat_n:,} / {rchat_n:,}"),
    ("CPU used by other processes, run A / B (cores)", "", "{foreign_a:.2f} / {foreign_b:.2f}"),
]  # fmt: skip


def table(results: dict[str, dict[str, Any]]) -> str:
    backends = list(results)
    lines = [
        f"| metric | target | {' | '.join(backends)} |",
        f"|---|---|{'---|' * len(backends)}",
    ]
    for label, target, fmt in ROWS:
        cells = []
        for b in backends:
            r = dict(results[b])
            r["idle_cpu_pct"] = r["idle_cpu"] * 100
            r["rss_per_instance_kb"] = (r["rss_mib"] - r["empty_rss_mib"]) * 1024 / r["instances"]
            r["idle_cpu_reconciling_pct"] = r["idle_cpu_reconciling"] * 100
            cells.append(fmt.format(**r))
        lines.append(f"| {label} | {target} | {' | '.join(cells)} |")
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="sqlite,etcd")
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=3, help="mocker worker processes")
    parser.add_argument("--tries", type=int, default=20, help="new registrations timed")
    parser.add_argument("--models-requests", type=int, default=500)
    parser.add_argument("--chat-seconds", type=float, default=10.0)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=120.0,
        help="seconds to wait, before each frontend, for other processes to go under 20%% of a core",
    )
    parser.add_argument("--serve-metadata", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_metadata:
        await serve_metadata()
        return
    print(
        f"command: {' '.join([Path(sys.executable).name, '-m', 'bench.registry', *sys.argv[1:]])}"
    )
    print(
        f"machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}, {platform.platform()}"
    )
    results: dict[str, dict[str, Any]] = {}
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-registry-"))
    print(f"logs and caches: {work}")
    for backend in args.backends.split(","):
        results[backend] = await bench_backend(backend, args, work)
        print(f"{backend}: {json.dumps(results[backend])}", flush=True)
    print(f"\n{args.instances:,} instances, {args.models:,} models, {args.workers} workers\n")
    print(table(results))


if __name__ == "__main__":
    asyncio.run(main())
