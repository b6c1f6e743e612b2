"""Load generators for bench/gateway.py and one measured run: wrk or the streaming client.

A run reads the CPU time of the gateway under test, of the worker, of the load generator and
of everything else on the machine before and after, so each figure comes with what it cost.
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gateway_targets import (
    API_KEY,
    CLK_TCK,
    ROOT,
    Proc,
    Session,
    Target,
    machine_busy,
    tree_cpu_seconds,
    tree_cpu_split,
)

WRK_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
wrk.body = [==[{body}]==]
"""
UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def write_wrk_script(path: Path, body: bytes) -> Path:
    path.write_text(WRK_SCRIPT.format(key=API_KEY, body=body.decode()))
    return path


def parse_latency(text: str) -> float:
    """wrk's `1.23ms`, `456.00us`, `1.02s` in milliseconds."""
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not match:
        raise ValueError(f"unexpected wrk latency {text!r}")
    return float(match.group(1)) * UNITS_MS[match.group(2)]


def parse_wrk(output: str) -> dict[str, Any]:
    """Requests, requests/s, p50/p99 (ms) and errors from `wrk --latency` output."""
    match = re.search(r"(\d+) requests in ([\d.]+)(\w+)", output)
    if not match:
        raise ValueError(f"no request count in wrk output:\n{output}")
    result: dict[str, Any] = {"requests": int(match.group(1))}
    match = re.search(r"Requests/sec:\s+([\d.]+)", output)
    result["requests_per_s"] = float(match.group(1)) if match else 0.0
    for pct in ("50", "99"):
        match = re.search(rf"^\s+{pct}(?:\.0+)?%\s+(\S+)", output, re.MULTILINE)
        result[f"p{pct}_ms"] = parse_latency(match.group(1)) if match else None
    match = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    non2xx = int(match.group(1)) if match else 0
    match = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    result["errors"] = non2xx + (sum(int(x) for x in match.groups()) if match else 0)
    result["ok"] = result["requests"] - non2xx
    return result


def run_wrk(
    session: Session, url: str, script: Path, concurrency: int, duration: float
) -> dict[str, Any]:
    """`wrk -t1 -cN -dS --latency`: one thread, N keep-alive connections, closed loop."""
    argv = [
        *session.client_prefix(),
        *("wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(duration))}s"),
        *("--timeout", "10s", "--latency", "-s", str(script), f"{url}/v1/chat/completions"),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr.strip()}")
    return parse_wrk(out.stdout)


def run_stream(
    session: Session, url: str, model: str, concurrency: int, duration: float, tokens: int
) -> dict[str, Any]:
    """bench/gateway_stream.py in its own process (so it can be pinned and its CPU counted)."""
    argv = [
        *session.client_prefix(),
        *(sys.executable, "-m", "bench.gateway_stream", "--url", url, "--model", model),
        *("--concurrency", str(concurrency), "--duration", str(duration)),
        *("--max-tokens", str(tokens), "--api-key", API_KEY),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 120, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"stream client failed ({out.returncode}): {out.stderr.strip()}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def wait_for_quiet(ours: list[Proc], max_wait: float, threshold_pct: float = 20.0) -> float:
    """Wait (up to `max_wait` s) until the processes outside the benchmark use less than
    `threshold_pct` of one core over a second; returns the seconds waited."""
    start = time.monotonic()
    while True:
        cpu0 = sum(tree_cpu_seconds(p.pid) for p in ours)
        busy0, _ = machine_busy()
        time.sleep(1.0)
        busy1, _ = machine_busy()
        foreign = (busy1 - busy0) / CLK_TCK - (sum(tree_cpu_seconds(p.pid) for p in ours) - cpu0)
        waited = time.monotonic() - start
        if foreign * 100 < threshold_pct or waited >= max_wait:
            return waited


def children_cpu() -> float:
    """CPU seconds of this process's finished children: the load generators."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(
    session: Session,
    target: Target,
    workers: list[Proc],
    idle: list[Proc],
    workload: str,
    duration: float,
    model: str,
    stream_tokens: int,
    wrk_script: Path,
) -> dict[str, Any]:
    """One run of `workload` ("c1", "c32" or "stream") against `target`, with its CPU costs.

    `idle` are the gateways not under test: what they burn meanwhile is background noise, and
    so is the CPU time that none of the benchmark's processes used (`foreign_cpu_pct`).
    """
    duration = max(1.0, duration * target.scale)
    gw0, gws0 = tree_cpu_split(target.proc.pid) if target.proc else (0.0, 0.0)
    wk0 = sum(tree_cpu_seconds(w.pid) for w in workers)
    idle0 = sum(tree_cpu_seconds(p.pid) for p in idle)
    cl0 = children_cpu()
    busy0, total0 = machine_busy()
    start = time.perf_counter()
    if workload == "stream":
        result = run_stream(session, target.url, model, 32, duration, stream_tokens)
    else:
        result = run_wrk(session, target.url, wrk_script, int(workload[1:]), duration)
    wall = time.perf_counter() - start
    busy1, total1 = machine_busy()
    client = children_cpu() - cl0
    idle_cpu = sum(tree_cpu_seconds(p.pid) for p in idle) - idle0
    gateway = worker_cpu = 0.0
    served = max(1, result["requests"])
    if target.proc:
        target.proc.check_alive()
        gw1, gws1 = tree_cpu_split(target.proc.pid)
        gateway = gw1 + gws1 - gw0 - gws0
        result["gateway_cpu_us_per_req"] = gateway / served * 1e6
        result["gateway_sys_us_per_req"] = (gws1 - gws0) / served * 1e6
    if workers:
        for worker in workers:
            worker.check_alive()
        worker_cpu = sum(tree_cpu_seconds(w.pid) for w in workers) - wk0
        result["worker_cpu_us_per_req"] = worker_cpu / served * 1e6
    busy = (busy1 - busy0) / CLK_TCK
    result["gateway_cpu_pct"] = gateway / wall * 100
    result["worker_cpu_pct"] = worker_cpu / wall * 100
    result["client_cpu_pct"] = client / wall * 100
    result["idle_gateways_cpu_pct"] = idle_cpu / wall * 100
    result["foreign_cpu_pct"] = (
        max(0.0, busy - gateway - worker_cpu - client - idle_cpu) / wall * 100
    )
    result["machine_busy_pct"] = (busy1 - busy0) / max(1, total1 - total0) * 100
    result["duration_s"] = duration
    return result
