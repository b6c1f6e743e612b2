"""Catalog benchmark (not a test): full garbage collections during the models controller's
passes over a big workspace (one url provider serving N models, N entities, N passthrough
virtual models), the API and the controller in one process as `shoal catalog serve` runs
them (an in-memory store), with `PassCollections` (as `serve` sets it) or without (`--off`).
Prints each full collection over 20 ms, whether it ran during a pass, and the totals.

    PYTHONPATH=src:. .venv/bin/python -m bench.catalog_pass_gc --models 10000 --passes 6
    PYTHONPATH=src:. .venv/bin/python -m bench.catalog_pass_gc --models 10000 --passes 6 --off
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from tests.catalog.controller_fixtures import WS, FakeBackend, RecordingClient, seed_converged

from shoal.catalog import PROVIDERS, CatalogConfig, CatalogServer
from shoal.catalog.collector import PassCollections
from shoal.catalog.controller import ModelsController
from shoal.store import open_store


async def main(models: int, passes: int, off: bool) -> None:
    names = [f"model-{i:05d}" for i in range(models)]
    app = web.Application()

    async def listing(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": n} for n in names]})

    app.router.add_get("/v1/models", listing)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    full: list[tuple[bool, float]] = []  # (during a pass, ms)
    state = {"in_pass": False, "started": 0.0}

    def watch(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            state["started"] = time.perf_counter()
        else:
            full.append((bool(state["in_pass"]), (time.perf_counter() - state["started"]) * 1e3))

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'catalog.db'}"
        server = CatalogServer(CatalogConfig(database_url=url, port=0))
        await server.start()
        await seed_converged(url, {"p": names})
        store = await open_store(f"memory://{uuid.uuid4().hex}")
        session = aiohttp.ClientSession()
        client = RecordingClient(server.url, workspace=WS)
        await client.update(PROVIDERS, "p", {"base_url": f"http://127.0.0.1:{port}/v1"})
        ctl = ModelsController(
            client, store, FakeBackend(), session, workspaces=[WS],
            collections=None if off else PassCollections(),
        )  # fmt: skip
        run_pass = ctl._pass

        async def a_pass() -> None:
            state["in_pass"] = True
            try:
                await run_pass()
            finally:
                state["in_pass"] = False

        ctl._pass = a_pass  # type: ignore[method-assign]
        gc.callbacks.append(watch)
        try:
            for number in range(passes):
                started = time.perf_counter()
                await ctl.step()
                print(f"pass {number + 1}: {time.perf_counter() - started:.1f} s", flush=True)
        finally:
            gc.callbacks.remove(watch)
            await client.close()
            await session.close()
            await store.close()
            await server.stop()
    await runner.cleanup()
    for during, ms in full:
        if ms > 20:
            print(f"full collection {'during a pass' if during else 'after a pass'}: {ms:.0f} ms")
    in_passes = [ms for d, ms in full if d]
    print(f"{'off' if off else 'on'}: {len(full)} full collections, {len(in_passes)} during passes "
          f"(longest {max(in_passes, default=0):.0f} ms); after: "
          f"{[round(ms) for d, ms in full if not d]} ms")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", type=int, default=10000)
    parser.add_argument("--passes", type=int, default=6)
    parser.add_argument("--off", action="store_true", help="without PassCollections")
    args = parser.parse_args()
    asyncio.run(main(args.models, args.passes, args.off))
