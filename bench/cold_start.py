"""Cold starts of `shoal frontend` from several source trees over one fleet (not a test).

    .venv/bin/python -m bench.cold_start --db /tmp/shoal-bench-registry-XXXX/sqlite.db \
        --instances 30000 [--rounds 3] [--stalls] [--poll S] [--profile PREFIX] TREE [TREE ...]

The fleet is a SQLite file that `bench.registry` left in its directory (its synthetic
instances and cards; their metadata files are served again, at the port the cards name, by
a process of their own). For each round and each TREE in turn (its `src` on `PYTHONPATH`), a
frontend starts with an empty metadata cache; reported: its ready line, the time until
`--instances` instances are routable (`shoal_frontend_live_instances`, read every `--poll`
seconds, 0.25 by default), its CPU seconds by then, and its RSS. Trees alternate within a
round, so a machine that slows down meanwhile slows both. `--stalls` asks `/live` every 5 ms
from the frontend's first answer (it listens before it is loaded) until every instance is
routable, from a process of its own (as `../shared/tools/stall_probe.py` does: a thread here
would share this process's interpreter and time it too), and reports the longest answer,
the longest gap between two answers and the p99. Each read of `/metrics` is work for the
frontend too (10,000 models: megabytes of text); a Prometheus reads it every 15-30 s, so
`--poll 5` judges the load's own holds. `--profile PREFIX` samples each frontend with
`py-spy` (if installed) into `PREFIX.N.txt` (raw, every thread).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from bench.registry import live_instances, metadata_app, process_cpu_seconds
from shoal.cli.common import parse_ready_line


def metadata_port(db: str) -> int:
    """The port of the metadata server the fleet's cards name."""
    row = (
        sqlite3.connect(db)
        .execute("SELECT value FROM kv WHERE key LIKE 'shoal/v1/models/bench/%' LIMIT 1")
        .fetchone()
    )
    found = re.search(rb"127\.0\.0\.1:(\d+)/meta/", row[0]) if row else None
    if found is None:
        raise SystemExit(f"{db}: no card of bench.registry's fleet")
    return int(found.group(1))


async def serve_metadata(port: int) -> web.AppRunner:
    runner = web.AppRunner(metadata_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


class Probe:
    """`GET /live` every `interval` from a process of its own (`--probe URL`), as
    `../shared/tools/stall_probe.py` does: a thread of this process would share its
    interpreter with the metadata server's loop and time that too."""

    def __init__(self, url: str, interval: float = 0.005) -> None:
        self.url, self.interval = url, interval
        self.proc: subprocess.Popen[str] | None = None
        self.result: dict[str, float] = {}

    def start(self) -> None:
        argv = [sys.executable, "-m", "bench.cold_start", "--probe", self.url]
        argv += ["--probe-interval", str(self.interval)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def stop(self) -> None:
        """End the probe (its stdin closed) and read its figures."""
        if self.proc is None:
            return
        out, _ = self.proc.communicate("", timeout=30)
        self.proc = None
        if out.strip():
            self.result = json.loads(out.strip().splitlines()[-1])

    def report(self) -> str:
        r = self.result
        if not r:
            return "/live: no answer"
        return (
            f"/live x{r['n']:.0f}: max {r['max']:.1f} ms, "
            f"gap {r['gap']:.1f} ms, p99 {r['p99']:.1f} ms"
        )


def probe_main(url: str, interval: float) -> None:
    """The probe's process: `GET /live` every `interval` until stdin closes, from the
    first answer on; then one JSON line of figures (ms) on stdout."""
    split = urlsplit(url)
    host, port = split.hostname or "", split.port
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    conn = http.client.HTTPConnection(host, port, timeout=60)
    latencies: list[float] = []
    gaps: list[float] = []
    last: float | None = None  # (the first answer: the frontend is listening)
    while not stop.is_set():
        began = time.monotonic()
        try:
            conn.request("GET", "/live")
            conn.getresponse().read()
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=60)
        else:
            now = time.monotonic()
            latencies.append((now - began) * 1000)
            if last is not None:
                gaps.append((now - last) * 1000)
            last = now
        time.sleep(max(0.0, interval - (time.monotonic() - began)))
    conn.close()
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)] if latencies else 0.0
    figures = {"n": len(latencies), "max": max(latencies, default=0.0)}
    figures.update(gap=max(gaps, default=0.0), p99=p99)
    print(json.dumps(figures), flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def cold_start(
    tree: str,
    db: str,
    instances: int,
    profile: str | None,
    stalls: bool = False,
    poll: float = 0.25,
) -> str:
    cache = tempfile.mkdtemp(prefix="shoal-cold-start-")
    env = {**os.environ, "PYTHONPATH": f"{tree}/src", "SHOAL_SETUP_TIMEOUT": "300"}
    env.pop("SHOAL_STORE", None)
    # (with `stalls`, a port known before the ready line: probed from the first answer)
    port = free_port() if stalls else 0
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "shoal.cli.main", "frontend", "--store", f"sqlite:///{db}"]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    args += ["--cache-dir", cache, "--reconcile-interval", "3600"]
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, env=env,
    )  # fmt: skip
    spy = None
    if profile is not None and shutil.which("py-spy"):
        spy = await asyncio.create_subprocess_exec(
            "py-spy", "record", "--pid", str(proc.pid), "--format", "raw", "--threads",
            "--nonblocking", "-r", "100", "-o", profile,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
    assert proc.stdout is not None
    probe = Probe(url) if stalls else None
    if probe is not None:
        probe.start()
    try:
        while (
            ready := parse_ready_line((await proc.stdout.readline()).decode(), "frontend")
        ) is None:
            if proc.returncode is not None:
                raise RuntimeError(f"the frontend of {tree} exited before it was ready")
        ready_s = time.perf_counter() - started
        async with aiohttp.ClientSession() as session:
            while await live_instances(session, ready["url"]) < instances:  # noqa: ASYNC110
                await asyncio.sleep(poll)  # (another process's state: polled)
        routable_s = time.perf_counter() - started
        if probe is not None:
            await asyncio.to_thread(probe.stop)
        cpu, rss = process_cpu_seconds(proc.pid), rss_mib(proc.pid)
    finally:
        if probe is not None:
            await asyncio.to_thread(probe.stop)
        if spy is not None:
            spy.send_signal(2)
            await spy.wait()
        proc.terminate()
        await proc.wait()
        shutil.rmtree(cache, ignore_errors=True)
    return (
        f"ready {ready_s:.1f} s, all routable {routable_s:.1f} s, "
        f"CPU {cpu:.1f} s, RSS {rss:.0f} MiB" + (f", {probe.report()}" if probe else "")
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", help="a SQLite file bench.registry left")
    parser.add_argument("--instances", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", help="py-spy raw samples to PREFIX.N.txt")
    parser.add_argument("--stalls", action="store_true", help="probe /live every 5 ms")
    parser.add_argument(
        "--poll",
        type=float,
        default=0.25,
        help="seconds between two reads of /metrics to tell when all are routable",
    )
    parser.add_argument("--probe", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--probe-interval", type=float, default=0.005, help=argparse.SUPPRESS)
    parser.add_argument("--serve-metadata", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("trees", nargs="*")
    args = parser.parse_args()
    helper = args.probe is not None or args.serve_metadata is not None
    if not helper and (args.db is None or args.instances is None or not args.trees):
        parser.error("--db, --instances and at least one TREE are required")
    return args


async def serve_metadata_forever(port: int) -> None:
    """The metadata server's process (`--serve-metadata PORT`): the fleet's files, served
    apart from the probe and this benchmark's polls."""
    runner = await serve_metadata(port)
    print("serving", flush=True)
    try:
        await asyncio.to_thread(sys.stdin.read)  # until the benchmark closes it
    finally:
        await runner.cleanup()


async def main(args: argparse.Namespace) -> None:
    argv = [sys.executable, "-m", "bench.cold_start", "--serve-metadata"]
    server = await asyncio.create_subprocess_exec(
        *argv, str(metadata_port(args.db)), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert server.stdout is not None and server.stdin is not None
    await server.stdout.readline()  # "serving"
    try:
        n = 0
        for _ in range(args.rounds):
            for tree in args.trees:
                n += 1
                profile = f"{args.profile}.{n}.txt" if args.profile else None
                result = await cold_start(
                    tree, args.db, args.instances, profile, args.stalls, args.poll
                )
                print(f"{tree}: {result}", flush=True)
    finally:
        server.stdin.close()
        await server.wait()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.probe is not None:
        probe_main(arguments.probe, arguments.probe_interval)
    elif arguments.serve_metadata is not None:
        asyncio.run(serve_metadata_forever(arguments.serve_metadata))
    else:
        asyncio.run(main(arguments))
