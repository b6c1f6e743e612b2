"""The longest turns of a frontend's event loop while 9 MB requests with an API key go through
it, in process (not a test): what the loop holds itself, apart from the machine's load.

    PYTHONPATH=src:. .venv/bin/python -m bench.keys_turns [--router prefix] [--requests 8]

A frontend with `--auth keys` in this process (a memory store, a grant without limits
reached) in front of a fake worker (`tests.frontend.support.FakeWorker`, which refuses a body
over 1 MiB: the frontend's work is what is judged), and a client in another thread sending
`bench.keys_stall`'s two 9 MB chats in turn. Every pass of the loop (asyncio's `_run_once`) is
timed: wall time, and the CPU time of the loop's thread in it (a pass that waits for a core,
or for the GIL a decoding thread holds, takes wall time, not CPU). Prints the longest passes.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import sys
import time

from bench.gateway_targets import API_KEY
from bench.keys_stall import bodies


def send(port: int, data: bytes, n: int, answers: list[int]) -> None:
    for _ in range(n):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request(
            "POST",
            "/v1/chat/completions",
            data,
            {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"},
        )
        answers.append(conn.getresponse().status)
        conn.close()


async def measure(args: argparse.Namespace) -> None:
    from tests.frontend.support import FakeWorker
    from tests.helpers import wait_for

    from shoal.discovery import Discovery
    from shoal.discovery.grants import Grant, hash_secret
    from shoal.frontend import Frontend, FrontendConfig
    from shoal.store import open_store

    store = await open_store("memory://")
    worker = await FakeWorker("bench-model").start()
    await worker.register(store)
    grant = Grant(workspace="default", name="bench", hash=hash_secret(API_KEY), tpm=10**11)
    await store.put(grant.key, grant.to_json())
    config = FrontendConfig(port=0, auth="keys", router=args.router, cache_dir=args.cache)
    front = Frontend(config, discovery=Discovery(store))
    await front.start()
    await wait_for(lambda: "bench-model" in front.registry.models and front.keys.by_hash)  # type: ignore[union-attr]
    loop = asyncio.get_running_loop()
    run_once = loop._run_once  # type: ignore[attr-defined]
    passes: list[tuple[float, float]] = []

    def timed() -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        run_once()
        passes.append((time.perf_counter() - wall, time.thread_time() - cpu))

    encoded = list(bodies().values())
    answers: list[int] = []
    loop._run_once = timed  # type: ignore[attr-defined]
    try:
        for i in range(args.requests):
            await asyncio.to_thread(send, front.port, encoded[i % 2], 1, answers)
    finally:
        loop._run_once = run_once  # type: ignore[attr-defined]
    await front.stop()
    await worker.stop()
    walls = sorted((w for w, _ in passes), reverse=True)
    cpus = sorted((c for _, c in passes), reverse=True)
    print(
        f"--router {args.router}, {args.requests} requests ({sorted(set(answers))}), "
        f"{len(passes)} passes of the loop; longest, wall ms: "
        + " ".join(f"{w * 1e3:.1f}" for w in walls[:5])
        + "; longest, the loop thread's CPU ms: "
        + " ".join(f"{c * 1e3:.1f}" for c in cpus[:5])
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--router", default="round-robin")
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        args.cache = cache
        asyncio.run(measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
