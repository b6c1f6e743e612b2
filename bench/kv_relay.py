"""KV relay benchmark (not a test): synthetic KV publishers -> `shoal kv-relay` -> JetStream.

    .venv/bin/python -m bench.kv_relay --workers 20 --rate 200 --seconds 20

Starts a `nats-server -js` on a free loopback port, a SQLite store, `--workers` synthetic
workers (shoal's own `KvEventPublisher`, registered in discovery with a KV endpoint as a
worker registers it; each publishes one `BlockStored` batch per tick at `--rate` batches/s),
one `shoal kv-relay` process, and a stream reader in its own process (an ordered JetStream
consumer, as a frontend with `--kv-events nats://...` reads) that measures the lag from the
worker's timestamp (`Shoal-Ts`) to delivery. Figures: lag p50/p99, batches relayed, the
relay's CPU (utime+stime from /proc) per 1,000 batches and as % of a core, the relay's
ESTABLISHED TCP connections (`ss`), and the connections 4 frontends x W workers open,
direct (ZMQ) vs through the relay.

    .venv/bin/python -m bench.kv_relay --workers 20 --rate 200 --seconds 20 --receive-only

The same workers, but instead of the relay a process that only receives (one
`KvSubscription` per worker, as the relay and a frontend have, applying nothing): the CPU per
batch of the ZMQ side alone, a floor under the relay's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def established(pid: int) -> int:
    out = subprocess.run(
        ["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=False
    ).stdout
    return sum(1 for line in out.splitlines() if f"pid={pid}," in line)


def spawn(argv: list[str], log: Path, *, pipe: bool = False) -> subprocess.Popen[bytes]:
    """Start `argv` with this checkout's `src` first; stderr (and stdout unless `pipe`) to `log`."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    with open(log, "wb") as out:
        stdout = subprocess.PIPE if pipe else out
        return subprocess.Popen(argv, stdout=stdout, stderr=out, env=env, cwd=ROOT)


def fetch(url: str) -> str:
    with urllib.request.urlopen(url) as resp:
        return str(resp.read().decode())


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def consume(url: str, seconds: float) -> None:
    """The stream reader: lag of every batch record delivered live, printed as JSON."""
    import nats
    from nats.js import api

    from shoal.kv import stream as layout

    nc = await nats.connect(url)
    js = nc.jetstream()
    lags: list[float] = []

    async def on_msg(msg: object) -> None:
        headers = msg.headers or {}  # type: ignore[attr-defined]
        if headers.get(layout.KIND) == layout.BATCH:
            lags.append((time.time() - float(headers[layout.TS])) * 1000)

    sub = await js.subscribe(
        f"{layout.SUBJECT_PREFIX}.>",
        ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.NEW,
        cb=on_msg,
    )
    print("consumer ready", flush=True)
    await asyncio.sleep(seconds)
    await sub.unsubscribe()
    await nc.close()
    print(json.dumps({"lags": lags}), flush=True)


async def run(args: argparse.Namespace) -> dict[str, object]:
    from shoal.cards import ModelCard, slugify
    from shoal.discovery import Discovery, EndpointId, InstanceInfo, ModelKey
    from shoal.kv import BlockStored
    from shoal.store import open_store
    from shoal.worker.kv_publisher import KvEventPublisher

    tmp = Path(tempfile.mkdtemp(prefix="shoal-bench-relay-", dir="/tmp"))
    nats_port = free_port()
    nats_url = f"nats://127.0.0.1:{nats_port}"
    binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
    procs: list[subprocess.Popen[bytes]] = []
    procs.append(spawn(
        [binary, "-js", "-a", "127.0.0.1", "-p", str(nats_port), "-sd", str(tmp / "js")],
        tmp / "nats.log",
    ))  # fmt: skip
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
            break
        except OSError:
            await asyncio.sleep(0.05)
    store_url = f"sqlite:///{tmp / 'store.db'}"
    store = await open_store(store_url)
    disc = Discovery(store)
    namespace = "bench"
    pubs: list[KvEventPublisher] = []
    card = ModelCard.build(
        display_name="bench-llm", slug=slugify("bench-llm"), source="hf://bench-llm",
        model_types=["chat"], context_length=4096, kv_block_size=16,
    )  # fmt: skip
    for i in range(args.workers):
        pub = KvEventPublisher()
        kv = await pub.start()
        pubs.append(pub)
        iid = 0x1000 + i
        endpoint = EndpointId(namespace, "backend", "generate")
        await disc.register_instance(
            InstanceInfo(namespace, "backend", "generate", iid, f"http://127.0.0.1:1/{iid}",
                         f"http://127.0.0.1:1/s{iid}", kv_events=kv),
            lease=0,
        )  # fmt: skip
        await disc.register_model(ModelKey(endpoint, iid), card, lease=0)
    relay_args = ["kv-relay", "--store", store_url, "--namespace", namespace,
                  "--nats", nats_url, "--status-port", "0"]  # fmt: skip
    launcher = ["-m", "shoal.cli.main"]
    if args.profile:
        launcher = ["-m", "bench.kv_relay", "--profile-relay", args.profile, "--"]
    if args.receive_only:
        endpoints = [f"{p.endpoint.publisher},{p.endpoint.replay}" for p in pubs if p.endpoint]
        launcher, relay_args = ["-m", "bench.kv_relay", "--receive"], endpoints
    relay = spawn([sys.executable, *launcher, *relay_args], tmp / "relay.log", pipe=True)
    procs.append(relay)
    assert relay.stdout is not None
    line = await asyncio.to_thread(relay.stdout.readline)
    if b"ready" not in line:
        raise RuntimeError(f"relay did not start: {line!r}; see {tmp / 'relay.log'}")
    status = re.search(rb"status=(\S+)", line)
    if status:
        print(f"relay status: {status.group(1).decode()}", file=sys.stderr, flush=True)
    total = args.seconds + args.warmup
    consumer = None
    if not args.receive_only:
        consumer = spawn(
            [sys.executable, "-m", "bench.kv_relay", "--consume", nats_url,
             "--seconds", str(total + 2)],
            tmp / "reader.log",
            pipe=True,
        )  # fmt: skip
        procs.append(consumer)
        assert consumer.stdout is not None
        await asyncio.to_thread(consumer.stdout.readline)
    load_before = os.getloadavg()[0]

    # Publish: every tick each publisher records one event (one batch per tick per worker).
    interval = 1.0 / args.rate
    tokens = list(range(16))
    start = time.monotonic()
    n = 0
    cpu0 = t0 = None
    sent0 = 0
    paused = None
    while (now := time.monotonic()) - start < total:
        if cpu0 is None and now - start >= args.warmup:
            cpu0, t0, sent0 = cpu_seconds(relay.pid), now, n * args.workers
        if args.pause_nats and paused is None and now - start >= args.warmup + 2:
            procs[0].send_signal(signal.SIGSTOP)  # NATS stalls: no acknowledgement comes
            paused = now
        if paused and now - paused >= args.pause_nats:
            procs[0].send_signal(signal.SIGCONT)
            paused = 0.0
        for i, pub in enumerate(pubs):
            h = (n << 8) | i
            pub.record(BlockStored(block_hashes=[h], parent_block_hash=None,
                                   token_ids=tokens, block_size=16))  # fmt: skip
        n += 1
        await asyncio.sleep(max(0.0, start + n * interval - time.monotonic()))
    t1 = time.monotonic()
    await asyncio.sleep(1.0)  # let the relay drain: its CPU for these batches is counted
    assert cpu0 is not None and t0 is not None
    cpu1 = cpu_seconds(relay.pid)
    sent = n * args.workers - sent0
    load_after = os.getloadavg()[0]
    relay_conns = established(relay.pid)
    metrics = ""
    if status:
        metrics = await asyncio.to_thread(fetch, f"{status.group(1).decode()}/metrics")
    lags: list[float] = []
    consumer_conns = 0
    if consumer is not None:
        consumer_conns = established(consumer.pid)
        out, _ = await asyncio.to_thread(consumer.communicate)
        lags = json.loads(out.decode().strip().splitlines()[-1])["lags"]
    relayed = re.search(r"^shoal_relay_batches_relayed_total (\S+)$", metrics, re.M)
    errors = re.search(r"^shoal_relay_publish_errors_total (\S+)$", metrics, re.M)
    for pub in pubs:
        await pub.close()
    await store.close()
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(10)
    shutil.rmtree(tmp, ignore_errors=True)
    cpu = cpu1 - cpu0
    frontends = 4
    return {
        "mode": "receive only" if args.receive_only else "relay",
        "load_average_1m": f"{load_before:.1f} -> {load_after:.1f}",
        "workers": args.workers,
        "rate_per_worker": args.rate,
        "offered_batches_per_s": args.workers * args.rate,
        "achieved_batches_per_s": round(sent / (t1 - t0), 1),
        "batches_relayed_total": float(relayed.group(1)) if relayed else None,
        "publish_errors": float(errors.group(1)) if errors else None,
        "lag_samples": len(lags),
        "lag_p50_ms": round(pct(lags, 0.5), 2),
        "lag_p99_ms": round(pct(lags, 0.99), 2),
        "lag_max_ms": round(max(lags), 2) if lags else None,
        "relay_cpu_s_per_1000_batches": round(cpu / sent * 1000, 4),
        # over the publishing window (the drain's CPU included): an upper bound
        "relay_cpu_pct_of_core": round(100 * cpu / (t1 - t0), 1),
        "relay_established_tcp": relay_conns,
        "reader_established_tcp": consumer_conns,
        # a ZMQ subscription holds one connection to the worker's PUB socket (its replay
        # socket only while replaying): measured above, 1 per worker + 1 to NATS per relay
        "direct_connections": f"{frontends} x {args.workers} = {frontends * args.workers}",
        "relay_connections": (f"{args.workers} + 1 + {frontends} = {args.workers + 1 + frontends}"),
    }


async def receive(endpoints: list[str]) -> None:
    """The receiving side alone: one `KvSubscription` per worker, applying nothing."""
    import zmq.asyncio

    from shoal.kv import KvEndpoint
    from shoal.kv.subscription import KvStats, KvSubscription

    ctx = zmq.asyncio.Context()
    stats = KvStats()
    subs = []
    for i, pair in enumerate(endpoints):
        publisher, replay = pair.split(",")
        sub = KvSubscription(ctx, i, KvEndpoint(publisher, replay), lambda s, b: None,
                             lambda: None, stats, whole_batches=True)  # fmt: skip
        sub.start()
        subs.append(sub)
    print("receiver ready", flush=True)
    await asyncio.Event().wait()  # until terminated


def profile_relay(out: str, argv: list[str]) -> None:
    """Run `shoal <argv>` under cProfile; the stats are written when it exits (SIGTERM)."""
    import cProfile

    from shoal.cli.main import main as shoal_main

    prof = cProfile.Profile()
    prof.enable()
    try:
        shoal_main(argv)
    finally:
        prof.disable()
        prof.dump_stats(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=20)
    p.add_argument("--rate", type=float, default=200.0, help="batches/s per worker")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--profile", help="write the relay's cProfile stats to this file")
    p.add_argument(
        "--receive-only",
        action="store_true",
        help="measure a process that only receives the workers' events (no relay)",
    )
    p.add_argument(
        "--pause-nats",
        type=float,
        default=0.0,
        help="stop nats-server (SIGSTOP) this many seconds, 2 s into the measured window",
    )
    p.add_argument("--receive", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--consume", help=argparse.SUPPRESS)
    p.add_argument("--profile-relay", help=argparse.SUPPRESS)
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.profile_relay:
        profile_relay(args.profile_relay, args.rest)
        return
    if args.receive is not None:
        import uvloop  # as `shoal kv-relay` runs

        uvloop.run(receive(args.receive))
        return
    if args.consume:
        asyncio.run(consume(args.consume, args.seconds))
        return
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
