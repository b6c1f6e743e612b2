"""Catalog benchmark (not a test): one client sends 24 x 4 usage batches of ~0.9 MB at once
(each invalid in its last row: decoded and validated whole, then 422, nothing written) while
another asks a small GET every 20 ms; the GET's latency meanwhile. A real `shoal catalog
serve` process on SQLite.

    PYTHONPATH=src:. .venv/bin/python -m bench.catalog_big_bodies
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp
from tests.helpers import free_port

SRC = os.path.abspath("src")
SERVE = "import sys; from shoal.cli.main import main; sys.argv[0] = 'shoal'; main()"


def batch() -> str:
    rows: list[dict[str, object]] = [
        {"workspace": "team-a", "key": "k" * 20, "model": "m", "served_model": "m",
         "status_class": "2xx", "minute": f"2030-01-01T00:{j % 60:02d}:00Z", "requests": 1,
         "prompt_tokens": 2, "completion_tokens": 3}
        for j in range(4400)
    ]  # fmt: skip
    rows[-1]["requests"] = -1
    return json.dumps({"batch_id": "batch-00000000", "rows": rows})


async def main() -> None:
    port = free_port()
    data = tempfile.mkdtemp()
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", SERVE, "catalog", "serve", "--port", str(port)),
        *("--db", f"sqlite:///{data}/c.db"),
        env={**os.environ, "PYTHONPATH": SRC},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                try:
                    async with session.get(base + "/v1/workspaces") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            body = batch()
            done = asyncio.Event()
            latencies: list[float] = []

            async def flood() -> None:
                for _ in range(4):
                    async with session.post(
                        base + "/v1/usage", data=body, headers={"content-type": "application/json"}
                    ) as resp:
                        await resp.read()
                        assert resp.status == 422, resp.status

            async def small() -> None:
                while not done.is_set():
                    started = time.monotonic()
                    async with session.get(base + "/v1/workspaces") as resp:
                        await resp.read()
                    latencies.append((time.monotonic() - started) * 1000)
                    await asyncio.sleep(0.02)

            prober = asyncio.create_task(small())
            started = time.monotonic()
            await asyncio.gather(*(flood() for _ in range(24)))
            took = time.monotonic() - started
            done.set()
            await prober
        latencies.sort()
        print(
            f"batch {len(body)} bytes; flood {took:.1f} s; small GET n={len(latencies)} "
            f"p50 {statistics.median(latencies):.0f} ms max {latencies[-1]:.0f} ms"
        )
    finally:
        proc.terminate()
        await proc.wait()


if __name__ == "__main__":
    asyncio.run(main())
