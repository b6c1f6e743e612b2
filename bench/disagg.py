"""Disaggregated serving benchmark (not a test): the same workers aggregated vs prefill + decode.

    .venv/bin/python -m bench.disagg            # the default run, a few minutes
    .venv/bin/python -m bench.disagg --quick    # a smoke test

Workers: `--workers` `shoal worker --engine mocker` processes with a cost model where prefill
interferes with decode on an aggregated worker: prefill takes `--prefill-us-per-token` per
uncached prompt token, one prefill at a time per worker, and stalls that worker's decode
steps for its duration (`--prefill-stalls-decode`); decode takes `--itl-ms` per token. In a
disaggregated layout the decode workers fetch the prefilled blocks from the prefill workers
over the mockers' side channel (`--kv-transfer-us-per-block` per block) and prefill nothing.
Each layout gets fresh workers and a fresh `shoal frontend`.

Workload (seeded): `--requests` chat requests, each with its own prompt of `--prompt-tokens`
tokens (no prefix shared: every prefill is whole) and `--max-tokens` output tokens,
streamed, arriving as a Poisson process of `--rate` requests per second (mixed arrival: the
prefills of new requests land while earlier ones decode).

Layouts: `4A` (four aggregated workers), `2P2D`, `1P3D` (prefill + decode workers).
Figures: TTFT p50/p99, ITL p50/p99 (the gaps between streamed tokens), requests/s, and the
gateway's CPU time per request (its process tree, from /proc).

`--overhead` measures only the gateway's cost of the two stages: `--overhead-requests`
small whole chats, 8 at a time, through `2A` and `1P1D` workers that answer at once
(`--speedup 0`), after a warm-up; the figure is the frontend's CPU time per request.

vllm-router's PD mode is not run: it needs the peers venv (bench/install-peers.sh, which
downloads it) and vLLM's own prefill/decode servers to bootstrap against; see
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.gateway_targets import (
    SHOAL,
    Proc,
    Session,
    StartError,
    chat_ok,
    free_port,
    git_version,
    http,
    tree_cpu_seconds,
    wait_until,
)
from bench.rounds import medians, percentile, publish, run_rounds
from shoal.worker.engines.mocker.text import VOCAB

MODEL = "disagg-bench"
LAYOUTS = ("4A", "2P2D", "1P3D")
TOKEN = re.compile(rb'"content":"[^"]')
READY = re.compile(r"shoal worker ready: .*url=(\S+) status=(\S+)")
WORDS = VOCAB[:115]  # the mocker's own words: one token each


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: 4A, 2P2D, ...")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prefill-us-per-token", type=float, default=100.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--kv-transfer-us-per-block", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--rounds", type=int, default=1, help="runs per layout (interleaved); medians")
    p.add_argument("--quick", action="store_true", help="a small run: a smoke test")
    p.add_argument("--overhead", action="store_true", help="the two-stage CPU cost only")
    p.add_argument("--overhead-requests", type=int, default=5000)
    p.add_argument("--report", type=Path, help="also write the markdown report here")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.prompt_tokens = 20, 32, 500
    return args


def parse_layout(layout: str) -> list[str]:
    """`4A` → four aggregated workers; `2P2D` → two prefill and two decode workers."""
    roles = []
    for count, kind in re.findall(r"(\d+)([APD])", layout):
        role = {"A": "aggregated", "P": "prefill", "D": "decode"}[kind]
        roles += [role] * int(count)
    if not roles:
        raise SystemExit(f"bench.disagg: no workers in layout {layout!r}")
    return roles


# --- workload ---------------------------------------------------------------------------------


def workload(args: argparse.Namespace) -> list[tuple[float, str]]:
    """Each request's arrival (seconds from the start) and prompt."""
    rng = random.Random(args.seed)
    at = 0.0
    out = []
    for i in range(args.requests):
        prompt = f"request {i} " + " ".join(
            rng.choice(WORDS) for _ in range(args.prompt_tokens - 2)
        )
        out.append((at, prompt))
        at += rng.expovariate(args.rate)
    return out


@dataclass
class Run:
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0


async def one(
    session: aiohttp.ClientSession, url: str, prompt: str, args: argparse.Namespace, run: Run
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "stream": True,
    }
    start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                run.errors += 1
                await resp.read()
                return
            last = None
            async for line in resp.content:
                if not TOKEN.search(line):
                    continue
                now = time.perf_counter()
                if last is None:
                    run.ttfts.append(now - start)
                else:
                    run.itls.append(now - last)
                last = now
    except aiohttp.ClientError:
        run.errors += 1


async def drive(url: str, requests: list[tuple[float, str]], args: argparse.Namespace) -> Run:
    run = Run()
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
        start = time.perf_counter()

        async def at(offset: float, prompt: str) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            await one(s, url, prompt, args, run)

        await asyncio.gather(*(at(offset, prompt) for offset, prompt in requests))
        run.seconds = time.perf_counter() - start
    return run


# --- processes --------------------------------------------------------------------------------


def start_workers(
    session: Session, roles: list[str], args: argparse.Namespace, store: str
) -> list[Proc]:
    procs = []
    for i, role in enumerate(roles):
        component = "backend" if role == "aggregated" else role
        if args.overhead:
            argv = [
                *SHOAL, "worker", "--engine", "mocker", "--model", MODEL, "--store", store,
                "--role", role, "--component", component, "--speedup", "0",
            ]  # fmt: skip
        else:
            argv = [
            *SHOAL, "worker", "--engine", "mocker", "--model", MODEL, "--store", store,
            "--host", "127.0.0.1", "--port", str(free_port()), "--status-port", str(free_port()),
            "--role", role, "--component", component, "--max-seqs", "256",
            "--prefill-us-per-token", str(args.prefill_us_per_token), "--prefill-stalls-decode",
            "--itl-ms", str(args.itl_ms),
            "--kv-transfer-us-per-block", str(args.kv_transfer_us_per_block),
            ]  # fmt: skip
        proc = session.start(f"worker-{i}-{role}", argv)
        wait_until(
            "the ready line",
            lambda proc=proc: bool(READY.search(proc.log.read_text(errors="replace"))),
            60,
            proc,
        )
        procs.append(proc)
    return procs


def start_frontend(session: Session, store: str, workers: int) -> tuple[Proc, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        *SHOAL, "frontend", "--store", store, "--host", "127.0.0.1", "--port", str(port),
        "--router", "least-loaded", "--cache-dir", str(session.workdir / "cache"),
    ]  # fmt: skip
    proc = session.start("frontend", argv)

    def ready() -> bool:
        health = json.loads(http("GET", f"{url}/health"))
        live = health.get("models", {}).get(MODEL, {}).get("instances", 0)
        return bool(live == workers and chat_ok(url, MODEL))

    wait_until(f"{workers} workers behind it and a chat completion", ready, 90, proc)
    return proc, url


async def overhead(url: str, n: int) -> int:
    """`n` small whole chats, 8 at a time; how many were answered 200."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 16}
    left = [n]
    ok = [0]
    async with aiohttp.ClientSession() as s:

        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    ok[0] += resp.status == 200

        await asyncio.gather(*(client() for _ in range(8)))
    return ok[0]


def run_overhead(layout: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    tdir = Path(tempfile.mkdtemp(dir=workdir, prefix=f"{layout}-"))
    session = Session(tdir, pin=False)
    store = f"sqlite:///{tdir / 'store.db'}"
    roles = parse_layout(layout)
    try:
        start_workers(session, roles, args, store)
        proc, url = start_frontend(session, store, len(roles))
        asyncio.run(overhead(url, 500))  # warm-up: pools, caches
        cpu0 = tree_cpu_seconds(proc.pid)
        start = time.perf_counter()
        ok = asyncio.run(overhead(url, args.overhead_requests))
        seconds = time.perf_counter() - start
        cpu = tree_cpu_seconds(proc.pid) - cpu0
        return {
            "layout": layout,
            "requests": ok,
            "errors": args.overhead_requests - ok,
            "rps": ok / seconds,
            "cpu_us_per_request": cpu / max(ok, 1) * 1e6,
        }
    finally:
        session.stop_all()


def run_layout(
    layout: str, args: argparse.Namespace, requests: list[tuple[float, str]], workdir: Path
) -> dict[str, Any]:
    tdir = Path(tempfile.mkdtemp(dir=workdir, prefix=f"{layout}-"))
    session = Session(tdir, pin=False)
    store = f"sqlite:///{tdir / 'store.db'}"
    roles = parse_layout(layout)
    try:
        start_workers(session, roles, args, store)
        proc, url = start_frontend(session, store, len(roles))
        cpu0 = tree_cpu_seconds(proc.pid)
        run = asyncio.run(drive(url, requests, args))
        cpu = tree_cpu_seconds(proc.pid) - cpu0
        served = len(run.ttfts)
        return {
            "layout": layout,
            "version": git_version(),
            "requests": served,
            "errors": run.errors,
            "ttft_p50_ms": percentile(run.ttfts, 0.5) * 1000,
            "ttft_p99_ms": percentile(run.ttfts, 0.99) * 1000,
            "itl_p50_ms": percentile(run.itls, 0.5) * 1000,
            "itl_p99_ms": percentile(run.itls, 0.99) * 1000,
            "rps": served / run.seconds if run.seconds else 0.0,
            "cpu_us_per_request": cpu / max(served, 1) * 1e6,
        }
    except StartError as exc:
        return {"layout": layout, "skipped": f"did not run: {str(exc).splitlines()[0]}"}
    finally:
        session.stop_all()


FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "rps", "cpu_us_per_request")


def report(results: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        f"Workload: {args.requests} streamed chats of {args.prompt_tokens} prompt tokens (none "
        f"shared) and {args.max_tokens} output tokens, Poisson arrivals at {args.rate:g}/s; "
        f"mocker workers: prefill {args.prefill_us_per_token:g} us/token, one at a time, "
        f"stalling the worker's decode steps; decode {args.itl_ms:g} ms/token; KV transfer "
        f"{args.kv_transfer_us_per_block:g} us/block; medians of {args.rounds} interleaved "
        "round(s), fresh workers and frontend for every run.",
        "",
        "| layout | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | req/s | gateway CPU us/req | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    notes = []
    for r in results:
        if "skipped" in r:
            notes.append(f"- {r['layout']}: skipped, {r['skipped']}")
            continue
        lines.append(
            f"| {r['layout']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
            f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['rps']:.2f} | "
            f"{r['cpu_us_per_request']:.0f} | {r['errors']} |"
        )
    return "\n".join([*lines, "", *notes])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    command = shlex.join([".venv/bin/python", "-m", "bench.disagg", *given])
    if args.overhead:
        rows = []
        with tempfile.TemporaryDirectory(prefix="shoal-disagg-bench-") as tmp:
            for _ in range(args.rounds):
                for layout in ("2A", "1P1D"):
                    rows.append(run_overhead(layout, args, Path(tmp)))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        lines = [
            f"Command: `{command}`",
            "",
            "| layout | gateway CPU us/req | req/s | errors |",
            "| --- | ---: | ---: | ---: |",
        ]
        for layout in ("2A", "1P1D"):
            runs = [r for r in rows if r["layout"] == layout]
            cpu = statistics.median(r["cpu_us_per_request"] for r in runs)
            rps = statistics.median(r["rps"] for r in runs)
            errors = sum(r["errors"] for r in runs)
            lines.append(f"| {layout} | {cpu:.0f} | {rps:.0f} | {errors} |")
        print("\n".join(lines))
        return 0
    requests = workload(args)
    with tempfile.TemporaryDirectory(prefix="shoal-disagg-bench-") as tmp:
        results = run_rounds(
            args.layouts.split(","),
            args.rounds,
            lambda layout: run_layout(layout, args, requests, Path(tmp)),
        )
    publish(
        report(medians(results, "layout", FIGURES), args, command), results, "disagg", args.report
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
