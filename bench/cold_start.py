"""Cold starts of `shoal frontend` from several source trees over one fleet (not a test).

    .venv/bin/python -m bench.cold_start --db /tmp/shoal-bench-registry-XXXX/sqlite.db \
        --instances 30000 [--rounds 3] [--profile PREFIX] TREE [TREE ...]

The fleet is a SQLite file that `bench.registry` left in its directory (its synthetic
instances and cards; their metadata files are served again here, at the port the cards
name). For each round and each TREE in turn (its `src` on `PYTHONPATH`), a frontend starts
with an empty metadata cache; reported: its ready line, the time until `--instances`
instances are routable (`shoal_frontend_live_instances`, polled every 0.25 s), its CPU
seconds by then, and its RSS. Trees alternate within a round, so a machine that slows down
meanwhile slows both. `--stalls` asks `/live` every 5 ms from the frontend's first answer (it
listens before it is loaded) until every instance is routable (as `../shared/tools/stall_probe.py` does, in a thread) and reports the
longest answer, the longest gap between two answers and the p99. `--profile PREFIX` samples each frontend with `py-spy` (if installed)
into `PREFIX.N.txt` (raw, every thread).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import re
import shutil
import socket
import sqlite3
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


class Probe(threading.Thread):
    """`GET /live` every `interval` until stopped: each answer's latency and the gaps."""

    def __init__(self, url: str, interval: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = urlsplit(url), interval
        self.latencies: list[float] = []
        self.gaps: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        host, port = self.url.hostname or "", self.url.port
        conn = http.client.HTTPConnection(host, port, timeout=60)
        last: float | None = None  # (the first answer: the frontend is listening)
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                conn.request("GET", "/live")
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=60)
            else:
                now = time.monotonic()
                self.latencies.append((now - began) * 1000)
                if last is not None:
                    self.gaps.append((now - last) * 1000)
                last = now
            time.sleep(max(0.0, self.interval - (time.monotonic() - began)))
        conn.close()

    def report(self) -> str:
        lat = sorted(self.latencies)
        p99 = lat[int(len(lat) * 0.99)] if lat else 0.0
        return (
            f"/live x{len(lat)}: max {max(lat, default=0):.1f} ms, "
            f"gap {max(self.gaps, default=0):.1f} ms, p99 {p99:.1f} ms"
        )


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
    tree: str, db: str, instances: int, profile: str | None, stalls: bool = False
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
                await asyncio.sleep(0.25)  # (another process's state: polled)
        routable_s = time.perf_counter() - started
        if probe is not None:
            probe.stop.set()
            await asyncio.to_thread(probe.join)
        cpu, rss = process_cpu_seconds(proc.pid), rss_mib(proc.pid)
    finally:
        if probe is not None:
            probe.stop.set()
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


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True, help="a SQLite file bench.registry left")
    parser.add_argument("--instances", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", help="py-spy raw samples to PREFIX.N.txt")
    parser.add_argument("--stalls", action="store_true", help="probe /live every 5 ms")
    parser.add_argument("trees", nargs="+")
    args = parser.parse_args()
    runner = await serve_metadata(metadata_port(args.db))
    try:
        n = 0
        for _ in range(args.rounds):
            for tree in args.trees:
                n += 1
                profile = f"{args.profile}.{n}.txt" if args.profile else None
                result = await cold_start(tree, args.db, args.instances, profile, args.stalls)
                print(f"{tree}: {result}", flush=True)
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
