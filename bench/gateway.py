"""Gateway benchmark (not a test): shoal's frontend against peer gateways, one mocker worker.

    bash bench/install-peers.sh                # once: peers into .bench/peers-venv, and wrk
    .venv/bin/python -m bench.gateway          # the full run, about 5 minutes
    .venv/bin/python -m bench.gateway --quick  # 2-second runs: a smoke test

One session runs the same workloads against each target, interleaved (each round runs every
workload against every target in turn, for `--rounds` rounds), all in front of one and the same
`shoal worker --engine mocker --speedup 0`, which answers at once:

  direct         the worker itself: the limit of this machine
  shoal          `shoal frontend` (store: a fresh SQLite file in a temp dir)
  shoal-p2       the same with `--processes 2`
  shoal-keys     the same with `--auth keys`: the bench's bearer is a grant in the store
  shoal-limits   `--auth keys --limits redis://...` on a throwaway redis-server (rpm and tpm
                 of the grant far above what is served: one Redis round trip per request)
  vllm-router    the Rust router of PyPI's `vllm-router`, `--policy round_robin`
  sglang-router  the Rust router of PyPI's `sglang-router`, `--policy round_robin`
  litellm        the LiteLLM proxy (Python), offline; its runs are shorter (it is slow)
  NAME@base      a shoal target run from the source tree `--base DIR` (PYTHONPATH=DIR/src):
                 a change and what it changes, measured interleaved in one session

Workloads: non-streaming chat completions at concurrency 1 and 32 (wrk, one thread, a Lua
script that POSTs a fixed body), and streaming chat completions of 128 tokens at concurrency 32
(bench/gateway_stream.py). Figures: requests/s, p50, p99, time to first token, streamed tokens/s,
each target's ratio to direct, and each gateway's CPU time per request: user+system time of its
whole process tree from /proc/PID/stat, before and after each run, over the requests served.

Peers that are not installed are skipped with a note. Output: a markdown report on stdout (and
in `--report FILE`), JSON in .bench/gateway-results.json, process logs in .bench/gateway-logs/.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gateway_load import measure, run_stream, run_wrk, wait_for_quiet, write_wrk_script
from bench.gateway_report import (
    NOISY_PCT,
    WORKLOADS,
    machine_info,
    report,
    summarize,
    targets_check,
)
from bench.gateway_targets import (
    ROOT,
    Proc,
    Session,
    StartError,
    Target,
    chat_body,
    git_version,
    peer_missing,
    start_litellm,
    start_sglang_router,
    start_shoal,
    start_vllm_router,
    start_worker,
)

TARGETS = (
    "direct",
    "shoal",
    "shoal-p2",
    "shoal-keys",
    "shoal-limits",
    "vllm-router",
    "sglang-router",
    "litellm",
)
OUT = ROOT / ".bench"
LOGS = OUT / "gateway-logs"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway",
        description="shoal's frontend against peer gateways, in front of one mocker worker.",
    )
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run (default 10)")
    p.add_argument(
        "--stream-duration", type=float, help="seconds per streaming run (default: --duration)"
    )
    p.add_argument(
        "--litellm-scale",
        type=float,
        default=0.3,
        help="LiteLLM's run length as a fraction of the others' (default 0.3; it serves ~75 req/s)",
    )
    p.add_argument("--quick", action="store_true", help="2-second runs: a smoke test")
    p.add_argument(
        "--pin",
        action="store_true",
        help="taskset: load generator on core 0, worker and gateway on core 1",
    )
    p.add_argument(
        "--targets", default=",".join(TARGETS), help="comma-separated subset (default: all)"
    )
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated subset of c1,c32,stream"
    )
    p.add_argument(
        "--base",
        type=Path,
        metavar="DIR",
        help="a source tree (a git worktree of the base branch) for the targets NAME@base",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="mocker workers (default 1); with 2 or more a chat stream through shoal may "
        "migrate, so shoal reads its events, as in any fleet of two or more",
    )
    p.add_argument(
        "--worker-speedup",
        type=float,
        default=0.0,
        help="the mockers' --speedup (default 0: each answer at once, a stream in one write "
        "with its length); above 0 a stream comes chunked, an event at a time, as from an "
        "engine (e.g. 100: 50 us between tokens)",
    )
    p.add_argument("--model", default="bench-model", help="the model the mocker serves")
    p.add_argument(
        "--max-tokens", type=int, default=16, help="non-streaming max_tokens (default 16)"
    )
    p.add_argument(
        "--stream-tokens", type=int, default=128, help="streaming max_tokens (default 128)"
    )
    p.add_argument(
        "--peers-venv",
        type=Path,
        default=OUT / "peers-venv",
        help="where install-peers.sh put them",
    )
    p.add_argument(
        "--worker-url",
        help="use this running OpenAI-compatible server instead of starting a mocker worker "
        "(shoal is then skipped: its frontend finds workers in the store)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        metavar="S",
        help="before each run, wait up to S seconds for other processes on the machine to use "
        "less than 20%% of a core (default 0: do not wait; their CPU is reported either way)",
    )
    p.add_argument("--json", type=Path, default=OUT / "gateway-results.json", help="results file")
    p.add_argument("--report", type=Path, help="also write the markdown report to this file")
    p.add_argument(
        "--profile",
        nargs="?",
        const="shoal",
        metavar="TARGET",
        help="after the measured runs, profile a shoal frontend (default: shoal; or shoal-keys, "
        "shoal-limits, ...) under wrk -c32 with py-spy (.bench/frontend.svg; top functions in "
        "the report)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 2.0
    if args.stream_duration is None:
        args.stream_duration = args.duration
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for name in args.targets:
        plain, based, _ = name.partition("@base")
        if plain not in TARGETS or (based and plain not in ("shoal", "shoal-keys", "shoal-limits")):
            p.error(
                f"unknown target {name!r}; known: {', '.join(TARGETS)} (and shoal, shoal-keys, shoal-limits @base)"
            )
        if based and args.base is None:
            p.error(f"{name} needs --base DIR")
        if based and not (args.base / "src" / "shoal").is_dir():
            p.error(f"--base {args.base}: no src/shoal there")
    for name in args.workloads:
        if name not in WORKLOADS:
            p.error(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if not shutil.which("wrk"):
        p.error("wrk is not installed: run bash bench/install-peers.sh")
    if args.pin and ((os.cpu_count() or 1) < 2 or not shutil.which("taskset")):
        p.error("--pin needs 2 cores and taskset")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(
        [".venv/bin/python", "-m", "bench.gateway", *(sys.argv[1:] if argv is None else argv)]
    )
    # SIGTERM or SIGHUP unwind through the `finally` below, which stops every process.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    pinning = (
        "the load generator (wrk, stream client) on core 0; the worker and the gateways on core 1 (taskset)"
        if args.pin
        else f"none: every process may run on any of the {os.cpu_count()} cores"
    )
    say(f"pinning: {pinning}")
    loadavg = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="shoal-bench-gateway-"))
    session = Session(workdir, args.pin)
    notes: list[str] = []
    runs: list[dict[str, Any]] = []
    targets: list[Target] = []
    profile: dict[str, Any] | None = None
    try:
        store = f"sqlite:///{workdir / 'store.db'}"
        workers: list[Proc] = []
        if args.worker_url:
            worker_urls = [args.worker_url.rstrip("/")]
            notes.append(f"backend: the server at {worker_urls[0]}, not a shoal mocker worker")
        elif importlib.util.find_spec("shoal.cli.worker") is None:
            say("shoal worker is not available (src/shoal/cli/worker.py): nothing to measure")
            return 1
        else:
            worker_urls = []
            try:
                for i in range(args.workers):
                    worker, worker_url = start_worker(
                        session, args.model, store, i, args.worker_speedup
                    )
                    workers.append(worker)
                    worker_urls.append(worker_url)
            except StartError as exc:
                say(f"the mocker worker did not start: {exc}")
                return 1
            say(f"workers ready at {', '.join(worker_urls)}")
            if args.workers > 1:
                notes.append(
                    f"{args.workers} mocker workers: shoal finds them in the store (a chat stream "
                    "may migrate, so it reads the events), vllm-router and sglang-router get "
                    "them all (round robin); direct and litellm use the first"
                )
        targets = start_targets(session, args, worker_urls, store, notes)
        wrk_script = write_wrk_script(workdir / "chat.lua", chat_body(args.model, args.max_tokens))
        # Warm-up, not measured: connection pools, caches, lazy imports.
        for target in list(targets):
            try:
                run_wrk(session, target.url, wrk_script, 32, max(1.0, 2.0 * target.scale))
                run_stream(session, target.url, args.model, 32, 1.0, args.stream_tokens)
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                targets.remove(target)
                notes.append(f"{target.name} skipped: its warm-up failed: {first_line(exc)}")
                say(f"{target.name}: warm-up failed: {exc}")
        total = args.rounds * len(args.workloads) * len(targets)
        failed: set[str] = set()
        for rnd in range(1, args.rounds + 1):
            for workload in args.workloads:
                for target in targets:
                    if target.name in failed:
                        continue
                    try:
                        result = quiet_run(
                            session, args, target, targets, workers, workload, wrk_script
                        )
                    except (RuntimeError, ValueError, StartError, subprocess.TimeoutExpired) as exc:
                        failed.add(target.name)
                        notes.append(
                            f"{target.name} dropped after a failed run ({workload}): {first_line(exc)}"
                        )
                        say(f"{target.name}: run failed: {exc}")
                        continue
                    result.update(target=target.name, workload=workload, round=rnd)
                    runs.append(result)
                    say(
                        f"[{len(runs)}/{total}] round {rnd} {workload:6} {target.name:13} "
                        f"{result['requests_per_s']:9,.0f} req/s  errors {result['errors']}"
                    )
        if args.profile:
            shoal = next((t for t in targets if t.name == args.profile), None)
            if shoal is not None:
                profile = profile_frontend(session, shoal, wrk_script, args.duration)
    finally:
        session.stop_all()
        keep_logs(workdir)
        shutil.rmtree(workdir, ignore_errors=True)

    names = [t.name for t in targets]
    summary = summarize(runs, names)
    data: dict[str, Any] = {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "pinning": pinning,
        "loadavg_at_start": loadavg,
        "rounds": args.rounds,
        "durations": {"wrk": args.duration, "stream": args.stream_duration},
        "litellm_scale": args.litellm_scale,
        "quiet_wait_s": args.quiet_wait,
        "workload": {
            "model": args.model,
            "max_tokens": args.max_tokens,
            "stream_tokens": args.stream_tokens,
        },
        "targets": names,
        "versions": {t.name: t.version for t in targets if t.name != "direct"},
        "notes": notes,
        "elapsed_s": round(time.monotonic() - started, 1),
        "summary": summary,
        "targets_check": targets_check(summary),
        "profile": profile,
        "runs": runs,
    }
    text = report(data)
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    if args.report:
        args.report.write_text(text)
    say(f"results: {args.json}; logs: {LOGS}; {data['elapsed_s']:.0f} s")
    return 0


def start_targets(
    session: Session, args: argparse.Namespace, worker_urls: list[str], store: str, notes: list[str]
) -> list[Target]:
    """Start the wanted targets; one that is missing or does not start is skipped with a note."""
    peers, model = args.peers_venv, args.model
    worker_url = worker_urls[0]
    base = args.base
    starters: dict[str, Callable[[], Target]] = {
        "direct": lambda: Target("direct", worker_url, None, version=git_version()),
        "shoal": lambda: start_shoal(session, model, store),
        "shoal-p2": lambda: start_shoal(session, model, store, processes=2),
        "shoal-keys": lambda: start_shoal(session, model, store, auth="keys"),
        "shoal-limits": lambda: start_shoal(session, model, store, auth="limits"),
        "shoal@base": lambda: start_shoal(session, model, store, base=base),
        "shoal-keys@base": lambda: start_shoal(session, model, store, auth="keys", base=base),
        "shoal-limits@base": lambda: start_shoal(session, model, store, auth="limits", base=base),
        "vllm-router": lambda: start_vllm_router(session, peers, worker_urls, model),
        "sglang-router": lambda: start_sglang_router(session, peers, worker_urls, model),
        "litellm": lambda: start_litellm(session, peers, worker_url, model, args.litellm_scale),
    }
    targets = []
    for name in args.targets:
        if name.startswith("shoal") and args.worker_url:
            why: str | None = "--worker-url given (the frontend finds workers in the store)"
        elif name.startswith("shoal") and importlib.util.find_spec("shoal.cli.frontend") is None:
            why = "shoal frontend is not available (src/shoal/cli/frontend.py)"
        elif name in ("vllm-router", "sglang-router", "litellm"):
            why = peer_missing(name, peers)
        else:
            why = None
        if why:
            notes.append(f"{name} skipped: {why}")
            say(f"{name} skipped: {why}")
            continue
        t0, before = time.monotonic(), len(session.procs)
        try:
            targets.append(starters[name]())
        except StartError as exc:
            for proc in session.procs[before:]:
                proc.stop()
            notes.append(
                f"{name} skipped: it did not start: {first_line(exc)} (log: {LOGS / name}.log)"
            )
            say(f"{name} did not start: {exc}")
            continue
        say(f"{name} ready in {time.monotonic() - t0:.1f} s")
    return targets


def quiet_run(
    session: Session,
    args: argparse.Namespace,
    target: Target,
    targets: list[Target],
    workers: list[Proc],
    workload: str,
    wrk_script: Path,
) -> dict[str, Any]:
    """One measured run. With --quiet-wait: wait for a quiet machine first, and run again (up to
    twice more) while other processes took more than NOISY_PCT of a core; keep the quietest."""
    duration = args.stream_duration if workload == "stream" else args.duration
    idle = [t.proc for t in targets if t.proc and t is not target]
    ours = [p for p in (*workers, *(t.proc for t in targets)) if p]
    best: dict[str, Any] | None = None
    for attempt in range(1, 4 if args.quiet_wait > 0 else 2):
        waited = wait_for_quiet(ours, args.quiet_wait) if args.quiet_wait > 0 else 0.0
        result = measure(
            session,
            target,
            workers,
            idle,
            workload,
            duration,
            args.model,
            args.stream_tokens,
            wrk_script,
        )
        result.update(quiet_wait_s=waited, attempts=attempt)
        if best is None or result["foreign_cpu_pct"] < best["foreign_cpu_pct"]:
            best = result
        if result["foreign_cpu_pct"] <= NOISY_PCT:
            break
        say(
            f"{target.name} {workload}: other processes used {result['foreign_cpu_pct']:.0f}% of a core"
        )
    assert best is not None
    best["attempts"] = attempt
    return best


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def say(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


def keep_logs(workdir: Path) -> None:
    """Copy the session's process logs to .bench/gateway-logs/, replacing the last session's."""
    shutil.rmtree(LOGS, ignore_errors=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    for log in workdir.glob("*.log"):
        shutil.copy(log, LOGS / log.name)


# A sampled stack with one of these frames is a thread waiting, not working.
IDLE_FRAME = re.compile(
    r"^(epoll_p?wait|PyThread_acquire_lock_timed|pthread_cond_\w*wait|futex\w*) "
)


def profile_frontend(
    session: Session, shoal: Target, wrk_script: Path, duration: float
) -> dict[str, Any]:
    """py-spy on the shoal frontend under wrk -c32: a flame graph, and time per function.

    The flame graph samples Python frames without stopping the process. The tables come from a
    second run with native frames too (uvloop, httptools and the system calls show up as C
    functions), for which py-spy stops the process at each sample: no run to take figures from.
    Samples of waiting threads (epoll, locks) are left out: percentages are of working time.
    """
    exe = Path(sys.executable).parent / "py-spy"
    spy = str(exe) if exe.exists() else shutil.which("py-spy")
    if spy is None or shoal.proc is None:
        return {"error": "py-spy not found (.venv/bin/pip install py-spy)"}
    seconds = max(2, round(duration))
    svg, raw = OUT / "frontend.svg", OUT / "frontend-native.txt"
    for fmt, path, extra in (("flamegraph", svg, "--nonblocking"), ("raw", raw, "--native")):
        argv = [spy, "record", "--pid", str(shoal.proc.pid), "--duration", str(seconds)]
        argv += ["--rate", "200", "--format", fmt, "--output", str(path), extra]
        spy_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # attached before the load starts
        run_wrk(session, shoal.url, wrk_script, 32, seconds + 1)
        _, err = spy_proc.communicate(timeout=60)
        if spy_proc.returncode != 0:
            return {"error": f"py-spy failed: {err.decode(errors='replace').strip()[-300:]}"}
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = idle = 0
    # Collapsed stacks, one a line: "frame;frame;... count", a frame being "function (file:line)".
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        frames = [re.sub(r"^0x[0-9a-f]+ ", "(unresolved) ", f) for f in frames]
        if any(IDLE_FRAME.match(f) for f in frames):
            idle += n
            continue
        samples += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + n

    def top(counts: dict[str, int], k: int) -> list[tuple[str, float]]:
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:k]
        return [(frame, round(n / max(1, samples) * 100, 1)) for frame, n in ranked]

    return {
        "target": shoal.name,
        "svg": str(svg.relative_to(ROOT)),
        "raw": str(raw.relative_to(ROOT)),
        "seconds": seconds,
        "samples": samples,
        "idle_samples": idle,
        "top_own": top(own, 15),
        # Total time: shoal's own functions only (the loop's C plumbing holds everything).
        "top_inclusive": top({f: n for f, n in total.items() if "(shoal/" in f}, 20),
    }


if __name__ == "__main__":
    sys.exit(main())
