"""Worker at scale (not a test): how long a worker serving many adapters holds its event loop.

    .venv/bin/python -m bench.worker_scale --adapters 20000
    .venv/bin/python -m bench.worker_scale --adapters 20000 --phases steady,lease-lost

One `shoal worker --engine openai` in front of a small upstream (served by this process)
listing a base model and `--adapters` LoRA adapters, on a SQLite store, `--lease-ttl` 5 s.
Once every adapter is announced, each phase runs `../shared/tools/stall_probe.py` against
the worker's status server (`/live`: an answer needs nothing but a turn of the worker's
loop) in back-to-back windows of `--window` seconds until the phase has converged, plus
one window more:

- `steady`: nothing changes (the lease loop renews and checks its keys; the models loop
  syncs an unchanged list);
- `add` / `remove`: the upstream lists 1,000 adapters more, then 1,000 fewer;
- `lease-lost`: the worker's lease is revoked behind its back (every key deleted); it
  grants a new one and puts every card again;
- `outage`: another connection holds the store's write lock for the TTL plus 2 s; the
  worker's lease expires and it re-registers everything when the store returns.

Prints one line per phase (the probe's worst answer, its longest gap between two answers,
the convergence time), and JSON with `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import Server, wait_for
from tests.processes import Process, Processes

from shoal.store import open_store

BASE = "fake/base-7b"
PROBE = Path(__file__).resolve().parents[2] / "shared" / "tools" / "stall_probe.py"
PROBE_LINE = re.compile(r"max (?P<max>[\d.]+) ms\s+longest gap (?P<gap>[\d.]+) ms")
CHANGE = 1000


class Upstream:
    """An OpenAI-compatible server listing `BASE` and adapters on it; its `/v1/models`
    reply is encoded once per change of the list, not per probe."""

    def __init__(self, adapters: int) -> None:
        self.body = b""
        self.set_adapters(range(adapters))
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.server = Server(app)

    def set_adapters(self, numbers: range) -> None:
        data: list[dict[str, Any]] = [{"id": BASE, "object": "model", "max_model_len": 8192}]
        data += [{"id": f"org/lora-{i:06d}", "object": "model", "parent": BASE} for i in numbers]
        self.body = json.dumps({"object": "list", "data": data}).encode()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.Response(body=self.body, content_type="application/json")


async def health(worker: Process) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(worker.status_url + "/health") as resp,
    ):
        return resp.status, await resp.json()


async def announced(worker: Process, models: int, *, not_instance: str | None = None) -> bool:
    """The worker is healthy with `models` announced (under a lease other than `not_instance`)."""
    status, body = await health(worker)
    count = sum(int(ep["models_announced"]) for ep in body.get("endpoints", []))
    return status == 200 and count == models and body["instance_id"] != not_instance


async def probe_window(url: str, seconds: float) -> tuple[float, float]:
    """One `stall_probe.py` run: its worst answer and longest gap, in ms."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(PROBE), url, "--seconds", str(seconds),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    match = PROBE_LINE.search(out.decode())
    if match is None:
        raise RuntimeError(f"stall_probe said: {out.decode()!r}")
    return float(match["max"]), float(match["gap"])


async def phase(
    name: str, worker: Process, window: float, change: Any, converged: Any, timeout: float
) -> dict[str, Any]:
    """Probe `worker` in windows while `change()` runs, until `converged()` and one window
    more; the worst answer and longest gap of all the windows, and the convergence time."""
    url = worker.status_url + "/live"
    windows: list[tuple[float, float]] = []
    started = time.monotonic()
    done_at: list[float] = []

    async def drive() -> None:
        await asyncio.sleep(0.5)  # (the probe runs first)
        await change()
        await wait_for(converged, timeout=timeout, interval=0.2, message=name)
        done_at.append(time.monotonic())

    task = asyncio.create_task(drive())
    while True:
        settled = task.done()
        windows.append(await probe_window(url, window))
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        if settled:  # (a whole window after the convergence)
            break
    result = {
        "phase": name,
        "max_ms": max(w[0] for w in windows),
        "longest_gap_ms": max(w[1] for w in windows),
        "converged_s": round(done_at[0] - started - 0.5, 2),
        "probed_s": len(windows) * window,
    }
    print(
        f"{name:11} max {result['max_ms']:7.1f} ms  longest gap {result['longest_gap_ms']:7.1f} ms"
        f"  converged in {result['converged_s']:6.2f} s  (probed {result['probed_s']:.0f} s)",
        flush=True,
    )
    return result


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", type=int, default=20_000)
    ap.add_argument("--lease-ttl", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=5.0, help="seconds per probe window")
    ap.add_argument("--phases", default="steady,add,remove,lease-lost,outage")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n = args.adapters
    upstream = Upstream(n)
    await upstream.server.start()
    with tempfile.TemporaryDirectory(prefix="shoal-worker-scale-") as tmp:
        path = Path(tmp) / "store.db"
        store_url = f"sqlite://{path}"
        store = await open_store(store_url)
        processes = Processes(Path(tmp))
        try:
            t0 = time.monotonic()
            worker = await processes.worker(
                store_url, "--upstream", upstream.server.url, "--lease-ttl", str(args.lease_ttl),
                model=BASE, engine="openai", timeout=300,
            )  # fmt: skip
            await wait_for(lambda: announced(worker, n + 1), timeout=600, interval=0.5)
            print(f"{n:,} adapters announced in {time.monotonic() - t0:.1f} s", flush=True)

            async def nothing() -> None:
                pass

            async def add() -> None:
                upstream.set_adapters(range(n + CHANGE))

            async def remove() -> None:
                upstream.set_adapters(range(n))

            held: dict[str, str] = {}

            async def revoke() -> None:
                held["instance"] = (await health(worker))[1]["instance_id"]
                await store.revoke(int(held["instance"], 16))

            async def outage() -> None:
                held["instance"] = (await health(worker))[1]["instance_id"]
                lock = sqlite3.connect(path, timeout=10, isolation_level=None)
                try:
                    lock.execute("BEGIN EXCLUSIVE")
                    await asyncio.sleep(args.lease_ttl + 2)
                finally:
                    lock.execute("ROLLBACK")
                    lock.close()

            async def back() -> bool:
                return await announced(worker, n + 1, not_instance=held["instance"])

            phases = {
                "steady": (nothing, lambda: announced(worker, n + 1)),
                "add": (add, lambda: announced(worker, n + 1 + CHANGE)),
                "remove": (remove, lambda: announced(worker, n + 1)),
                "lease-lost": (revoke, back),
                "outage": (outage, back),
            }
            results = []
            for name in args.phases.split(","):
                change, converged = phases[name]
                results.append(await phase(name, worker, args.window, change, converged, 600))
            if args.json:
                print(json.dumps({"adapters": n, "lease_ttl": args.lease_ttl, "phases": results}))
        finally:
            await processes.close()
            await store.close()
            await upstream.server.stop()


if __name__ == "__main__":
    asyncio.run(main())
