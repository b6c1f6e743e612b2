"""CPU per request of the gateway's request path, in process (not a test): what the frontend's
own Python costs per request, free of sockets, of the worker and of a busy machine's noise.

    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.request_path
    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.request_path --base /tmp/base  # and base's
    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.request_path --instructions [--base DIR]
    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.request_path --profile 25 --modes stream

Each request goes the frontend's way (`Endpoints.handle`, `Proxy.handle`, a `Forward`, the
round-robin `Router`, an `UpstreamConnection`) from the client's bytes fed to a real
`HttpConnection` to the response bytes it writes, over fake transports: the worker answers at
once, its response fed to the upstream connection as packets. Modes:

  plain    a non-streaming chat completion: one packet each way
  stream   a streaming one of `--chunks` SSE events (128), one packet per event, then [DONE]
  whole    the same stream written at once with its `Content-Length`, one packet, as the
           mocker at `--speedup 0` sends it (`bench.gateway`'s default stream workload)
  keys     `plain` with `--auth keys`: the bearer checked, the key's allow-list and its rpm
           and tpm on local windows (never reached), `Gate` (no usage recorded)

Figures: user+system CPU time of this process over `--requests` requests (after a warm-up),
per request, the best of `--repeat` runs. `--instructions` counts instructions instead, under
valgrind (cachegrind, no cache simulation), each mode minus a `--null` run that sets up the
same and serves nothing: load-independent, so the figure to compare on a shared machine.
`--base DIR` runs the same (this file) in a subprocess on DIR/src and prints both.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("plain", "stream", "whole", "keys")
HERE = Path(__file__).resolve().parent.parent  # (this bench, run on another tree's src)
BODY = json.dumps(
    {"model": "bench-model", "messages": [{"role": "user", "content": "Hello! " * 8}],
     "max_tokens": 16}
).encode()  # fmt: skip
STREAM_BODY = json.dumps(
    {"model": "bench-model", "messages": [{"role": "user", "content": "Hello! " * 8}],
     "max_tokens": 128, "stream": True}
).encode()  # fmt: skip
ANSWER = json.dumps(
    {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion", "created": 1764000000,
     "model": "bench-model", "choices": [{"index": 0, "finish_reason": "length",
     "message": {"role": "assistant", "content": "word " * 16}}],
     "usage": {"prompt_tokens": 14, "completion_tokens": 16, "total_tokens": 30}}
).encode()  # fmt: skip


def client_request(body: bytes) -> bytes:
    """What wrk's Lua script (bench/gateway_load.py) sends."""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Content-Type: application/json\r\nAuthorization: Bearer sk-bench\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


def worker_response() -> list[bytes]:
    """A non-streaming answer, one packet."""
    return [
        b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 12:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
    ]


def stream_events(chunks: int) -> list[bytes]:
    """The SSE events of a streamed answer of `chunks` pieces, then [DONE]."""
    events = []
    for i in range(chunks):
        delta = json.dumps(
            {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk",
             "created": 1764000000, "model": "bench-model",
             "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]},
            separators=(",", ":"),
        ).encode()  # fmt: skip
        events.append(b"data: " + delta + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def worker_stream(chunks: int) -> list[bytes]:
    """A streamed answer: the head with the first event, then one packet per event."""
    packets = [b"%x\r\n%s\r\n" % (len(e), e) for e in stream_events(chunks)]
    packets[-1] += b"0\r\n\r\n"
    head = (
        b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 12:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"connection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    packets[0] = head + packets[0]
    return packets


def worker_whole(chunks: int) -> list[bytes]:
    """The same events in one body with its length, in one packet (the mocker at speedup 0)."""
    body = b"".join(stream_events(chunks))
    head = (
        b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 12:00:00 GMT\r\n"
        b"server: Python/3.11 aiohttp/3.13\r\ncontent-type: text/event-stream\r\n"
        b"cache-control: no-cache\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    return [head + body]


class Transport:
    """An asyncio transport that keeps nothing but the count of bytes written to it."""

    def __init__(self) -> None:
        self.written = 0
        self.writes = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written += len(data)
        self.writes += 1

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    abort = close

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class Bench:
    """One frontend's request path wired to fake transports, ready to serve requests."""

    def __init__(self, chunks: int, instances: int = 1, keys: bool = False) -> None:
        from shoal.cards import ModelType, WorkerRole
        from shoal.discovery.grants import Grant, hash_secret
        from shoal.frontend.endpoints import Endpoints
        from shoal.frontend.http.listener import HttpServer
        from shoal.frontend.http.server import HttpConnection
        from shoal.frontend.http.upstream import Upstream, UpstreamConnection
        from shoal.frontend.keys.gate import Gate
        from shoal.frontend.keys.keys import KeyRing
        from shoal.frontend.keys.limits import Limits
        from shoal.frontend.proxy.proxy import Proxy
        from shoal.frontend.registry.metrics import FrontendMetrics
        from shoal.frontend.registry.registry import Model, Registry, SetId, WorkerSet
        from shoal.frontend.registry.router import make_router

        registry = Registry()
        ws = WorkerSet(SetId("bench-model", "ns", "backend", WorkerRole.AGGREGATED), "sum")
        # Two instances or more: a chat stream may migrate, so the gateway reads its events.
        upstreams = [Upstream(i + 1, f"http://127.0.0.{i + 1}:9") for i in range(instances)]
        ws.routable = tuple(upstreams)
        model = Model(
            "bench-model",
            routable_sets=(ws,),
            model_types=frozenset({ModelType.CHAT}),
            _cum_weights=(instances,),
        )
        model._kinds[ModelType.CHAT] = model
        registry.models["bench-model"] = model
        self.proxy = Proxy(registry, make_router("round-robin"), FrontendMetrics())
        endpoints = Endpoints()
        endpoints.cors = None
        endpoints.keys = None
        endpoints._keys = ()
        endpoints.proxy = self.proxy
        endpoints.router = self.proxy.router
        if keys:  # (as `Frontend` wires them, with a grant for the bearer the client sends)
            endpoints.keys = ring = KeyRing(["default"])
            grant = Grant(workspace="default", name="bench", hash=hash_secret("sk-bench"),
                          rpm=10**11, tpm=10**11)  # fmt: skip
            ring.put(grant.key, grant.to_json())
            endpoints.limits = Limits(None)
            endpoints.gate = Gate(endpoints.limits, self.proxy.handle, None)
        self.server = HttpServer(endpoints.handle, max_body=1 << 20)
        self.client = HttpConnection(self.server)
        self.client_transport = Transport()
        self.client.connection_made(self.client_transport)  # type: ignore[arg-type]
        self.workers: list[tuple[Upstream, UpstreamConnection, Transport]] = []
        for upstream in upstreams:
            worker = UpstreamConnection(upstream)
            transport = Transport()
            worker.connection_made(transport)  # type: ignore[arg-type]
            upstream.idle.append(worker)
            self.workers.append((upstream, worker, transport))
        stream = client_request(STREAM_BODY)
        plain = client_request(BODY)
        self.requests = {"plain": plain, "stream": stream, "whole": stream, "keys": plain}
        self.responses = {
            "plain": worker_response(),
            "stream": worker_stream(chunks),
            "whole": worker_whole(chunks),
            "keys": worker_response(),
        }

    def serve(self, mode: str, n: int) -> None:
        """`n` requests, one after the other on one keep-alive connection, as wrk -c1 does."""
        import shoal.frontend.http.upstream as upstream_module

        request = self.requests[mode]
        packets = self.responses[mode]
        client_received = self.client.data_received
        workers = self.workers
        if len(workers) == 1:
            _, worker, worker_sent = workers[0]
            worker_received = worker.data_received
            client = self.client
            counts = hasattr(worker, "_room")  # (the upstream's room: since the 8th session)
            room = getattr(upstream_module, "FEED_SLICE", 0)  # (a turn's room, whole)
            for _ in range(n):
                # Each request of wrk -c1 comes in a turn of its own; the connections count
                # body pieces until they give a turn (`TURN_CALLS`, the upstream's `_room`),
                # which this loop never runs.
                client._calls = 0
                if counts:
                    worker._room = room
                writes = worker_sent.writes
                client_received(request)
                assert worker_sent.writes == writes + 1, "the request did not reach the worker"
                for packet in packets:
                    worker_received(packet)
        else:
            rooms = [
                getattr(upstream_module, "FEED_SLICE", 0) if hasattr(c, "_room") else None
                for _, c, _ in workers
            ]
            for _ in range(n):
                self.client._calls = 0  # (as above)
                for (_, connection, _), room in zip(workers, rooms, strict=True):
                    if room is not None:
                        connection._room = room
                before = [sent.writes for _, _, sent in workers]
                client_received(request)
                (chosen,) = [w for w, b in zip(workers, before, strict=True) if w[2].writes > b]
                worker_received = chosen[1].data_received
                for packet in packets:
                    worker_received(packet)
        assert self.client.idle and not self.client.closed, "the client connection broke"
        for upstream, worker, _ in workers:
            assert upstream.idle == [worker], "a worker connection was not pooled"

    def check(self) -> None:
        stats = self.proxy.metrics.models["bench-model"].requests
        assert set(stats) == {200}, stats


async def measure(args: argparse.Namespace) -> dict[str, float]:
    plain = Bench(args.chunks, args.instances)
    keyed = Bench(args.chunks, args.instances, keys=True) if "keys" in args.modes else plain
    benches = {mode: keyed if mode == "keys" else plain for mode in args.modes}
    for mode in args.modes:  # one request each, `--null` too: what is done once is not counted
        benches[mode].serve(mode, 1)
    await asyncio.sleep(0)
    out: dict[str, float] = {}
    for mode in args.modes:
        n = args.requests if mode != "stream" else max(1, args.requests // args.chunks * 4)
        if args.null:
            out[mode] = float(n)
            continue
        bench = benches[mode]
        if args.profile:
            bench.serve(mode, n)
            profile = cProfile.Profile()
            profile.runcall(bench.serve, mode, n)
            print(f"## {mode}: {n:,} requests")
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
            continue
        best = float("inf")
        for attempt in range(args.repeat + 1):  # the first is a warm-up
            started = time.process_time()
            bench.serve(mode, n)
            cost = (time.process_time() - started) / n * 1e6
            if attempt:
                best = min(best, cost)
            await asyncio.sleep(0)  # the loop runs its timers (the server's sweep, ...)
        out[mode] = best
    if not args.null:
        for bench in {id(b): b for b in benches.values()}.values():
            bench.check()
    return out


def run(args: argparse.Namespace) -> dict[str, float]:
    import uvloop

    return uvloop.run(measure(args))


def instructions(
    args: argparse.Namespace, trees: dict[str, Path | None]
) -> dict[str, dict[str, float]]:
    """Instructions per request of each mode in each tree (name: its src, None for this one),
    under valgrind: the mode minus `--null`. The runs go in parallel: counts do not mind."""
    runs: dict[tuple[str, str, bool], subprocess.Popen[str]] = {}
    for name, src in trees.items():
        env = dict(os.environ, PYTHONHASHSEED="0")
        if src is not None:
            env["PYTHONPATH"] = f"{src}{os.pathsep}{HERE}"
        # A short run first, outside valgrind, so that every module is compiled (`.pyc`)
        # before counting: compiling in one run of a pair and not the other is noise.
        quick = [sys.executable, "-m", "bench.request_path", "--json", "--requests", "10",
                 "--repeat", "1", "--modes", ",".join(args.modes)]  # fmt: skip
        subprocess.run(quick, env=env, capture_output=True, check=True)
        for mode in args.modes:
            for null in (False, True):
                argv = [
                    "valgrind", "--tool=cachegrind", "--cache-sim=no",
                    "--cachegrind-out-file=/dev/null", sys.executable, "-m", "bench.request_path",
                    "--json", "--repeat", "1", "--requests", str(args.requests),
                    "--chunks", str(args.chunks), "--instances", str(args.instances),
                    "--modes", mode,
                ] + (["--null"] if null else [])  # fmt: skip
                runs[name, mode, null] = subprocess.Popen(
                    argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
    counts: dict[tuple[str, str, bool], tuple[int, float]] = {}
    for key, process in runs.items():
        stdout, stderr = process.communicate()
        refs = re.search(r"I\s+refs:\s+([\d,]+)", stderr)
        if process.returncode or refs is None:
            raise RuntimeError(f"{key}: {stderr[-800:]}")
        counts[key] = (int(refs.group(1).replace(",", "")), json.loads(stdout)[key[1]])
    out: dict[str, dict[str, float]] = {}
    for name, mode, null in counts:
        if not null:
            full = counts[name, mode, False][0]
            empty, n = counts[name, mode, True]  # (the null run says how many requests)
            # A warm-up and one run: twice n requests.
            out.setdefault(name, {})[mode] = (full - empty) / (2 * n)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.request_path", description=__doc__)
    p.add_argument("--requests", type=int, default=20_000, help="per run of plain (default 20,000)")
    p.add_argument("--chunks", type=int, default=128, help="SSE events per stream (default 128)")
    p.add_argument(
        "--instances",
        type=int,
        default=1,
        help="instances of the model (default 1); 2 or more: a chat stream may migrate, so the "
        "gateway reads each of its events (as in any fleet of two or more)",
    )
    p.add_argument("--repeat", type=int, default=5, help="runs per mode; the best counts")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    p.add_argument("--base", type=Path, help="also run on DIR/src (a worktree of the base)")
    p.add_argument("--instructions", action="store_true", help="count instructions under valgrind")
    p.add_argument("--null", action="store_true", help="set up, serve nothing (for valgrind)")
    p.add_argument("--profile", type=int, metavar="N", help="cProfile one run: top N")
    p.add_argument("--json", action="store_true", help="print the figures as JSON only")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if args.profile:
        run(args)
        return 0
    if args.instructions:
        trees = {"ours": None, **({"base": args.base.resolve() / "src"} if args.base else {})}
        counted = instructions(args, trees)
        ours, base = counted["ours"], counted.get("base")
        unit = "instructions per request (valgrind)"
    else:
        ours = run(args)
        base = None
        if args.base is not None:
            argv2 = [sys.executable, "-m", "bench.request_path", "--json",
                     "--requests", str(args.requests), "--repeat", str(args.repeat),
                     "--chunks", str(args.chunks), "--instances", str(args.instances),
                     "--modes", ",".join(args.modes)]  # fmt: skip
            env = {
                **os.environ,
                "PYTHONPATH": f"{args.base.resolve() / 'src'}{os.pathsep}{HERE}",
            }
            out = subprocess.run(argv2, env=env, capture_output=True, text=True, check=True)
            base = json.loads(out.stdout)
        unit = f"CPU µs per request, best of {args.repeat}"
    if args.json:
        print(json.dumps(ours))
        return 0
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{unit}; stream: {args.chunks} events; {args.instances} instance(s). Load average: {load}"
    )
    head = "| mode | this tree |" + (" base | this ÷ base |" if base else "")
    print(head)
    print("| --- " * (head.count("|") - 1) + "|")
    for mode in args.modes:
        fmt = "{:,.0f}" if args.instructions else "{:.2f}"
        row = f"| {mode} | {fmt.format(ours[mode])} |"
        if base is not None:
            row += f" {fmt.format(base[mode])} | {ours[mode] / base[mode]:.3f} |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
