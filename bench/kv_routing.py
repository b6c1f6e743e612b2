"""KV-aware routing benchmark (not a test): shared-prefix chat traffic through each router.

    .venv/bin/python -m bench.kv_routing            # the default run, a few minutes
    .venv/bin/python -m bench.kv_routing --quick    # a smoke test

Workers: `--workers` `shoal worker --engine mocker` processes with a realistic cost model:
prefill time proportional to the uncached prompt tokens (`--prefill-us-per-token`, one
prefill at a time per worker), a KV cache of `--kv-blocks` blocks with LRU eviction, and
`--itl-ms` per decoded token. They publish KV events (vLLM's format) for the routers that
read them. Each target gets fresh workers (empty caches), started the same way.

Workload (seeded, reproducible): `--system-prompts` system prompts of `--system-tokens`
tokens; `--conversations` conversations, each on one system prompt, of `--turns` turns
whose user message (`--user-tokens`) and a fixed assistant reply are appended to the
history, so each turn's prompt extends the previous one. `--concurrency` clients each run
conversations one turn at a time, streaming. The default sizes the caches so that the four
workers together hold the working set but none alone does.

Targets: shoal `round-robin`, `prefix` and `kv`; vllm-router `cache_aware` and `kv_aware`
(fed the workers' ZMQ events, which its workers publish as tagged maps, `--kv-events-format
map`, the form it decodes; it gets each prompt's token ids from the worker's
`/v1/chat/completions/render`, as from vLLM); sglang-router `cache_aware` (peers from
bench/install-peers.sh; a peer that is missing or does not run is skipped with a note).
Figures: prefix cache hit rate (from the workers' metrics), TTFT p50/p99, requests/s, and
the gateway's CPU time per request (its process tree, from /proc). For vllm-router `kv_aware`,
what shows it is fed: its own counts of prompts rendered, KV lookups that hit, and event
batches it refused (its log's warnings).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.gateway_targets import (
    CLK_TCK,
    ROOT,
    SHOAL,
    Proc,
    Session,
    StartError,
    chat_ok,
    free_port,
    git_version,
    http,
    machine_busy,
    peer_missing,
    peer_version,
    tree_cpu_seconds,
    wait_until,
)
from bench.rounds import medians, percentile, publish, run_rounds
from shoal.worker.engines.mocker.text import VOCAB

MODEL = "kv-bench"
FIRST_TOKEN = re.compile(rb'"content":"[^"]')
PEERS = ROOT / ".bench" / "peers-venv"
TARGETS = (
    "shoal:round-robin",
    "shoal:prefix",
    "shoal:kv",
    "vllm-router:cache_aware",
    "vllm-router:kv_aware",
    "sglang-router:cache_aware",
)
WORDS = VOCAB[:115]  # the mocker's own words: one token each


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--conversations", type=int, default=128)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--user-tokens", type=int, default=60)
    p.add_argument("--reply-tokens", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=512, help="per worker")
    p.add_argument("--prefill-us-per-token", type=float, default=100.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--kv-overlap-weight", type=float, help="shoal's --router kv (default: its own)")
    p.add_argument("--rounds", type=int, default=1, help="runs per target (interleaved); medians")
    p.add_argument("--quick", action="store_true", help="a small run: a smoke test")
    p.add_argument(
        "--workload",
        choices=("default", "wide"),
        default="default",
        help="wide: more system prompts and longer chats than the four caches hold at 1,024 "
        "blocks (96 system prompts, 256 conversations of 6 turns): no router reaches the "
        "ceiling of compulsory misses (sets the sizes it names; other options still apply)",
    )
    p.add_argument(
        "--base-src",
        type=Path,
        metavar="DIR",
        help="run targets named base:<policy> as a shoal frontend from this source tree (its "
        "src/ directory), e.g. an export of main: a before/after in one run",
    )
    p.add_argument("--report", type=Path, help="also write the markdown report here")
    p.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="sample each shoal frontend with py-spy during its run: collapsed stacks in DIR",
    )
    args = p.parse_args(argv)
    if args.workload == "wide":
        args.system_prompts, args.conversations, args.turns = 96, 256, 6
        if "--kv-blocks" not in (argv or sys.argv[1:]):
            args.kv_blocks = 1024
    if args.quick:
        args.conversations, args.turns, args.system_prompts = 16, 2, 8
    return args


# --- workload ---------------------------------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversations(args: argparse.Namespace) -> list[list[list[dict[str, str]]]]:
    """Each conversation's requests (message lists), turn by turn."""
    rng = random.Random(args.seed)
    systems = [
        f"system {i} " + words(rng, args.system_tokens - 2) for i in range(args.system_prompts)
    ]
    out = []
    for _ in range(args.conversations):
        history = [{"role": "system", "content": systems[rng.randrange(len(systems))]}]
        turns = []
        for _turn in range(args.turns):
            history = [*history, {"role": "user", "content": words(rng, args.user_tokens)}]
            turns.append(history)
            history = [*history, {"role": "assistant", "content": words(rng, args.reply_tokens)}]
        out.append(turns)
    return out


@dataclass
class Run:
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0


async def one(
    session: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    args: argparse.Namespace,
    run: Run,
) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": args.max_tokens, "stream": True}
    start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                run.errors += 1
                await resp.read()
                return
            first = None
            async for line in resp.content:
                # The first token: the first chunk with text (the role chunk before it has none).
                if first is None and FIRST_TOKEN.search(line):
                    first = time.perf_counter() - start
            if first is not None:
                run.ttfts.append(first)
    except aiohttp.ClientError:
        run.errors += 1


async def drive(url: str, convs: list[list[list[dict[str, str]]]], args: argparse.Namespace) -> Run:
    run = Run()
    queue: asyncio.Queue[list[list[dict[str, str]]]] = asyncio.Queue()
    for conv in convs:
        queue.put_nowait(conv)

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            for messages in queue.get_nowait():
                await one(session, url, messages, args, run)

    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, headers={"Authorization": "Bearer x"}
    ) as s:
        start = time.perf_counter()
        await asyncio.gather(*(client(s) for _ in range(args.concurrency)))
        run.seconds = time.perf_counter() - start
    return run


# --- processes --------------------------------------------------------------------------------


@dataclass
class Worker:
    proc: Proc
    url: str
    status: str
    kv_pub: str
    kv_replay: str


READY = re.compile(r"shoal worker ready: .*url=(\S+) status=(\S+)")


def start_workers(
    session: Session, args: argparse.Namespace, store: str, kv_format: str = "array"
) -> list[Worker]:
    """Fresh mocker workers publishing KV events in `kv_format` (`--kv-events-format`)."""
    workers = []
    for i in range(args.workers):
        port, kv_port = free_port(), free_port()
        argv = [
            *SHOAL, "worker", "--engine", "mocker", "--model", MODEL, "--store", store,
            "--host", "127.0.0.1", "--port", str(port), "--status-port", str(free_port()),
            "--block-size", str(args.block_size), "--kv-blocks", str(args.kv_blocks),
            "--prefill-us-per-token", str(args.prefill_us_per_token), "--itl-ms", str(args.itl_ms),
            "--kv-events-port", str(kv_port), "--kv-events-format", kv_format, "--max-seqs", "64",
        ]  # fmt: skip
        proc = session.start(f"worker-{i}", argv)
        found: list[re.Match[str]] = []

        def printed(proc: Proc = proc, found: list[re.Match[str]] = found) -> bool:
            match = READY.search(proc.log.read_text(errors="replace"))
            if match:
                found.append(match)
            return bool(match)

        wait_until("the ready line", printed, 60, proc)
        url, status = found[0].group(1).rstrip("/"), found[0].group(2).rstrip("/")
        replay = _replay_endpoint(store, url)
        workers.append(Worker(proc, url, status, f"tcp://127.0.0.1:{kv_port}", replay))
    return workers


def _replay_endpoint(store: str, url: str) -> str:
    """The replay socket the worker advertises in discovery (its port is chosen at start)."""
    from shoal.discovery import Discovery
    from shoal.store import open_store

    async def find() -> str:
        s = await open_store(store)
        try:
            for info in await Discovery(s).list_instances():
                if info.url.rstrip("/") == url and info.kv_events is not None:
                    return info.kv_events.replay
        finally:
            await s.close()
        return ""

    return asyncio.run(find())


def start_relay(session: Session, store: str) -> str:
    """A `nats-server -js` of its own and a `shoal kv-relay` following every namespace of the
    store into it: the URL a frontend's `--kv-events` reads (issue 25's comparison)."""
    nats_port = free_port()
    url = f"nats://127.0.0.1:{nats_port}"
    binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
    data = session.workdir / f"jetstream-{nats_port}"
    nats = session.start(
        f"nats-{nats_port}",
        [binary, "-js", "-a", "127.0.0.1", "-p", str(nats_port), "-sd", str(data)],
    )
    wait_until("nats-server", lambda: _listens(nats_port), 30, nats)
    status = free_port()
    relay = session.start(
        f"relay-{nats_port}",
        [*SHOAL, "kv-relay", "--store", store, "--namespaces-from-discovery", "--nats", url,
         "--host", "127.0.0.1", "--status-port", str(status)],
    )  # fmt: skip
    wait_until("the relay's status port", lambda: _listens(status), 60, relay)
    return url


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def start_target(
    session: Session, name: str, workers: list[Worker], store: str, args: argparse.Namespace
) -> tuple[Proc, str, str, str]:
    """The gateway `name` in front of `workers`: its process, URL, version, and the URL of a
    peer's Prometheus metrics ("" for shoal, whose metrics are on its own port)."""
    gateway, policy = name.split(":")
    port = free_port()
    metrics = ""
    url = f"http://127.0.0.1:{port}"
    urls = [w.url for w in workers]
    env = None
    if gateway in ("shoal", "base", "shoal-nats"):
        argv = [
            *SHOAL, "frontend", "--store", store, "--host", "127.0.0.1", "--port", str(port),
            "--router", policy, "--cache-dir", str(session.workdir / "cache"),
        ]  # fmt: skip
        if gateway == "shoal-nats":  # the workers' events through a relay and JetStream
            argv += ["--kv-events", start_relay(session, store)]
        if args.kv_overlap_weight is not None:
            argv += ["--kv-overlap-weight", str(args.kv_overlap_weight)]
        version = git_version()
        if gateway == "base":
            if args.base_src is None:
                raise StartError("base:<policy> targets need --base-src")
            env = {"PYTHONPATH": str(args.base_src.resolve() / "src")}
            version = f"base ({args.base_src.name})"
    elif gateway == "vllm-router":
        prometheus = free_port()
        metrics = f"http://127.0.0.1:{prometheus}/metrics"
        argv = [
            str(PEERS / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *urls, "--policy", policy, "--log-level", "warning",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus),
        ]  # fmt: skip
        if policy == "kv_aware":
            for w in workers:
                argv += ["--kv-event-source", f"{w.url}={w.kv_pub}"]
                argv += ["--kv-event-replay-source", f"{w.url}={w.kv_replay}"]
            argv += ["--kv-event-block-size", str(args.block_size), "--kv-event-model", MODEL]
        version = peer_version(PEERS, "vllm-router")
    else:
        argv = [
            str(PEERS / "bin" / "python"), "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
            "--policy", policy, "--log-level", "warn",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        ]  # fmt: skip
        version = peer_version(PEERS, "sglang-router")
    proc = session.start(name.replace(":", "-"), argv, env)

    def ready() -> bool:
        if gateway in ("shoal", "base", "shoal-nats"):
            models = json.loads(http("GET", f"{url}/v1/models"))
            health = json.loads(http("GET", f"{url}/health"))
            live = health.get("models", {}).get(MODEL, {}).get("instances", 0)
            if live != len(workers) or not any(
                m.get("id") == MODEL for m in models.get("data", [])
            ):
                return False
        return chat_ok(url, MODEL)

    wait_until(f"{len(workers)} workers behind it and a chat completion", ready, 90, proc)
    return proc, url, version, metrics


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """User+system CPU seconds of `pid`'s main thread ("main": the event loop's, in shoal)
    and of its other threads ("threads": the tokenizer's, the store's, ZMQ's), from /proc."""
    out = {"main": 0.0, "threads": 0.0}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            stat = (task / "stat").read_bytes()
            fields = stat[stat.rindex(b")") + 2 :].split()
            out["main" if task.name == str(pid) else "threads"] += (
                int(fields[11]) + int(fields[12])
            ) / CLK_TCK
    return out  # (threads that ended meanwhile are left out: the tree's total has them)


def start_profile(
    session: Session, name: str, proc: Proc, out: Path | None
) -> subprocess.Popen[bytes] | None:
    """py-spy sampling `proc` (and its threads) until interrupted, into `out`/<target>-<n>.txt."""
    if out is None:
        return None
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.glob(f"{name.replace(':', '-')}-*.txt")))
    target = out / f"{name.replace(':', '-')}-{n}.txt"
    argv = [spy, "record", "--pid", str(proc.pid), "--rate", "1000", "--format", "raw"]
    argv += ["--output", str(target), "--nonblocking", "--threads"]
    spy_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached before the load starts
    return spy_proc


def kv_figures(url: str) -> dict[str, float]:
    """A shoal kv frontend's own counts: prompts prepared in its tokenizer's thread instead
    of inline, and routed by prefix instead of by blocks (and of those, too slow)."""
    text = http("GET", f"{url}/metrics").decode()
    out = {}
    for name in ("deferred_prompts", "prefix_fallbacks", "slow_prompts", "picks"):
        found = re.search(rf"^shoal_frontend_kv_{name}_total (\S+)$", text, re.M)
        out[f"kv_{name}"] = float(found.group(1)) if found else float("nan")
    return out


VLLM_REFUSED = re.compile(r"kv_index decode batch|dense batch rejected|invalid KV event")


def vllm_kv_figures(metrics: str, log: Path) -> dict[str, float]:
    """What shows vllm-router's `kv_aware` is fed: prompts the workers rendered for it (and
    preparations that found no tokens), KV placement lookups that hit or missed, and the
    event batches it refused (its log's warnings: it logs each one)."""
    text = http("GET", metrics).decode()
    out = {"vllm_rendered": 0.0, "vllm_no_tokens": 0.0, "vllm_hits": 0.0, "vllm_misses": 0.0}
    for labels, value in re.findall(
        r"^vllm_router_kv_routing_inputs_total\{([^}]*)\} (\S+)$", text, re.M
    ):
        key = "vllm_rendered" if 'result="render"' in labels else "vllm_no_tokens"
        out[key] += float(value)
    for labels, value in re.findall(
        r"^vllm_router_kv_placement_lookups_total\{([^}]*)\} (\S+)$", text, re.M
    ):
        key = "vllm_hits" if 'result="hit"' in labels else "vllm_misses"
        out[key] += float(value)
    out["vllm_refused_batches"] = float(len(VLLM_REFUSED.findall(log.read_text(errors="replace"))))
    return out


def cache_figures(workers: list[Worker]) -> tuple[float, float]:
    hits = queries = 0.0
    for w in workers:
        text = http("GET", f"{w.status}/metrics").decode()
        for name, value in re.findall(
            r"^(shoal_mocker_prefix_cache_(?:hits|queries)_tokens_total)\{[^}]*\} (\S+)$",
            text,
            re.M,
        ):
            if "hits" in name:
                hits += float(value)
            else:
                queries += float(value)
    return hits, queries


# --- main -------------------------------------------------------------------------------------


def run_target(
    name: str, args: argparse.Namespace, convs: list[Any], workdir: Path
) -> dict[str, Any]:
    gateway = name.split(":")[0]
    if gateway not in ("shoal", "base", "shoal-nats") and (why := peer_missing(gateway, PEERS)):
        return {"target": name, "skipped": why}
    tdir = Path(tempfile.mkdtemp(dir=workdir, prefix=name.replace(":", "-") + "-"))
    session = Session(tdir, pin=False)
    store = f"sqlite:///{tdir / 'store.db'}"
    try:
        # vllm-router 0.1.17's kv_aware decodes only the tagged-map form of the events.
        kv_format = "map" if name == "vllm-router:kv_aware" else "array"
        workers = start_workers(session, args, store, kv_format)
        proc, url, version, metrics = start_target(session, name, workers, store, args)
        # The readiness probe went through one worker; count from here on.
        hits0, queries0 = cache_figures(workers)
        shoal = gateway in ("shoal", "base", "shoal-nats")
        spy = start_profile(session, name, proc, args.profile) if shoal else None
        cpu0, threads0 = tree_cpu_seconds(proc.pid), thread_cpu_seconds(proc.pid)
        run = asyncio.run(drive(url, convs, args))
        cpu = tree_cpu_seconds(proc.pid) - cpu0
        threads = thread_cpu_seconds(proc.pid)
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its samples and exits
            spy.wait(30)
        hits, queries = cache_figures(workers)
        kv = kv_figures(url) if shoal and name.endswith(":kv") else {}
        if name == "vllm-router:kv_aware":
            kv = vllm_kv_figures(metrics, proc.log)
        served = len(run.ttfts)
        return {
            "target": name,
            "version": version,
            "requests": served,
            "errors": run.errors,
            "hit_rate": (hits - hits0) / max(queries - queries0, 1.0),
            "ttft_p50_ms": percentile(run.ttfts, 0.5) * 1000,
            "ttft_p99_ms": percentile(run.ttfts, 0.99) * 1000,
            "rps": served / run.seconds if run.seconds else 0.0,
            "cpu_us_per_request": cpu / max(served, 1) * 1e6,
            "main_cpu_us_per_request": (threads["main"] - threads0["main"]) / max(served, 1) * 1e6,
            **kv,
        }
    except StartError as exc:
        return {"target": name, "skipped": f"did not run: {str(exc).splitlines()[0]}"}
    finally:
        session.stop_all()


def main_thread(result: dict[str, Any]) -> str:
    """The event loop's share of a shoal gateway's CPU (a peer's threads are its own)."""
    shoal = result["target"].split(":")[0] in ("shoal", "base", "shoal-nats")
    return f"{result['main_cpu_us_per_request']:.0f}" if shoal else "-"


def report(results: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        f"Workload: {args.workers} workers ({args.kv_blocks} KV blocks of {args.block_size} tokens each, "
        f"prefill {args.prefill_us_per_token:g} us/token, {args.itl_ms:g} ms/token decode); "
        f"{args.system_prompts} system prompts of {args.system_tokens} tokens, {args.conversations} "
        f"conversations x {args.turns} turns (+{args.user_tokens} user, +{args.reply_tokens} reply tokens "
        f"per turn), concurrency {args.concurrency}, streaming, max_tokens {args.max_tokens}; "
        f"medians of {args.rounds} interleaved round(s), fresh workers for every run.",
        "",
        f"Machine: {args.machine}.",
        "",
        "| target | version | hit rate | TTFT p50 ms | TTFT p99 ms | req/s | gateway CPU us/req "
        "| of which main thread | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    notes = []
    for r in results:
        if "skipped" in r:
            notes.append(f"- {r['target']}: skipped, {r['skipped']}")
            continue
        if "vllm_rendered" in r:
            notes.append(
                f"- {r['target']}: {r['vllm_rendered']:.0f} prompts rendered by the workers, "
                f"{r['vllm_no_tokens']:.0f} without tokens; KV lookups {r['vllm_hits']:.0f} hit, "
                f"{r['vllm_misses']:.0f} missed; {r['vllm_refused_batches']:.0f} event batches "
                "refused (the first round's counts)"
            )
        lines.append(
            f"| {r['target']} | {r['version']} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['rps']:.1f} | {r['cpu_us_per_request']:.0f} | "
            f"{main_thread(r)} | {r['errors']} |"
        )
    return "\n".join([*lines, "", *notes])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(
        [
            ".venv/bin/python",
            "-m",
            "bench.kv_routing",
            *(argv if argv is not None else sys.argv[1:]),
        ]
    )
    convs = conversations(args)
    busy0, total0 = machine_busy()
    with tempfile.TemporaryDirectory(prefix="shoal-kv-bench-") as tmp:
        results = run_rounds(
            args.targets.split(","),
            args.rounds,
            lambda name: run_target(name, args, convs, Path(tmp)),
        )
    busy1, total1 = machine_busy()
    args.machine = (
        f"{os.cpu_count()} cores, {(busy1 - busy0) / max(total1 - total0, 1):.0%} busy over the "
        f"run (every process on the machine), load average {os.getloadavg()[0]:.1f} at the end"
    )
    figures = (
        "hit_rate",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "rps",
        "cpu_us_per_request",
        "main_cpu_us_per_request",
    )
    publish(
        report(medians(results, "target", figures), args, command),
        results,
        "kv-routing",
        args.report,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
