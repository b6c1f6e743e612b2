"""Catalog benchmark (not a test): 10,000 model entities and 10,000 virtual models in one
workspace; a full paginated list of each, and single gets, through the HTTP API. With
`--controller`: the models controller's passes over 4 providers x 102 models, every catalog
call delayed 60 ms by a middleware (a catalog across a network).

    .venv/bin/python -m bench.catalog [--backends sqlite,postgresql] [--entities 10000]
    .venv/bin/python -m bench.catalog --controller [--backends sqlite,postgresql]

The API runs as a real `shoal catalog serve` process; the client is `CatalogClient` (aiohttp)
in this one. Rows are seeded with one bulk insert (the subject is reading them back), each
validated by the kind's create model first. PostgreSQL: SHOAL_TEST_POSTGRES_URL, else the
server on 127.0.0.1:5432, else a throwaway cluster (as the tests do); a fresh database each run.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import sys
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

from tests.helpers import free_port, wait_for
from tests.postgres_server import PostgresDatabase

from shoal.catalog import MODELS, VIRTUAL_MODELS, CatalogClient, Kind
from shoal.catalog.database import migrate, open_engine
from shoal.catalog.tables import workspaces
from shoal.cli.common import parse_ready_line

WORKSPACE = "bench"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def body(kind: Kind[Any], i: int) -> dict[str, Any]:
    if kind is MODELS:
        return {
            "name": f"org-{i % 97}/model-{i:05d}",
            "base_model": f"org-{i % 97}/base-{i % 500}",
            "format": "safetensors",
            "context_length": 8192,
            "providers": [f"{WORKSPACE}/provider-{i % 4}"],
            "spec": {"quantization": "none", "tags": ["chat", "bench"]},
        }
    return {"name": f"alias-{i:05d}", "default_model": f"org-{i % 97}/model-{i:05d}"}


async def seed(url: str, n: int) -> None:
    engine = open_engine(url)
    await migrate(engine)
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        await conn.execute(workspaces.insert().values(name=WORKSPACE, version=1, created_at=now))
        for kind in (MODELS, VIRTUAL_MODELS):
            rows = []
            for i in range(n):
                made = kind.create.model_validate(body(kind, i))
                data = made.model_dump(mode="json", exclude={"name"})
                rows.append(
                    {"workspace": WORKSPACE, "name": made.name, "version": 1,  # type: ignore[attr-defined]
                     "created_at": now, "updated_at": now, "data": data}
                )  # fmt: skip
            await conn.execute(kind.table.insert(), rows)
    await engine.dispose()


async def measure(api: str, n: int, rounds: int, gets: int) -> dict[str, float]:
    result: dict[str, float] = {}
    async with CatalogClient(api, workspace=WORKSPACE) as client:
        for kind in (MODELS, VIRTUAL_MODELS):
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                items = await client.list_all(kind, page_size=1000)
                times.append(time.perf_counter() - start)
                assert len(items) == n, len(items)
            result[f"{kind.plural} list s (median of {rounds})"] = pct(times, 0.5)
            names = [body(kind, random.randrange(n))["name"] for _ in range(gets)]
            latencies = []
            for name in names:
                start = time.perf_counter()
                await client.get(kind, name)
                latencies.append((time.perf_counter() - start) * 1000)
            result[f"{kind.plural} get p50 ms"] = pct(latencies, 0.5)
            result[f"{kind.plural} get p99 ms"] = pct(latencies, 0.99)
    return result


async def run_backend(url: str, args: argparse.Namespace) -> dict[str, float]:
    await seed(url, args.entities)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shoal.cli.main", "catalog", "serve", "--db", url,
        "--port", str(free_port()), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        ready = parse_ready_line(line, "catalog")
        assert ready is not None, line
        return await measure(ready["url"], args.entities, args.rounds, args.gets)
    finally:
        proc.terminate()
        await proc.wait()


class Delay:
    """ASGI middleware: every HTTP request waits `seconds` before the app sees it."""

    def __init__(self, app: Any, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await asyncio.sleep(self.seconds)
        await self.app(scope, receive, send)


async def controller_passes(url: str, args: argparse.Namespace) -> dict[str, float]:
    """A cold pass, then `rounds` steady passes, of 4 url providers x 102 models."""
    import uvicorn
    from tests.catalog.controller_fixtures import WS, controller_on, openai_servers

    from shoal.catalog import PROVIDERS
    from shoal.catalog.api import create_app

    engine = open_engine(url)
    await migrate(engine)
    port = free_port()
    app = Delay(create_app(engine, migrate_on_start=False), args.delay_ms / 1000)
    config = uvicorn.Config(app, port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    await wait_for(lambda: server.started, timeout=30, message="the catalog API started")
    served = [[f"p{i}/model-{j:03d}" for j in range(102)] for i in range(4)]
    result: dict[str, float] = {}
    try:
        async with (
            openai_servers(*served) as upstreams,
            controller_on(f"http://127.0.0.1:{port}", workspaces=[WS]) as (ctl, client, _),
        ):
            for i, upstream in enumerate(upstreams):
                await client.create(
                    PROVIDERS, {"name": f"p{i}", "type": "url", "base_url": upstream.base_url}
                )
            await ctl.step()
            assert ctl.last is not None
            result["cold pass calls"] = ctl.last.calls
            result["cold pass s"] = ctl.last.seconds
            steady = []
            for _ in range(args.rounds):
                await ctl.step()
                steady.append(ctl.last.seconds)
                result["steady pass calls"] = ctl.last.calls
            result[f"steady pass s (median of {args.rounds})"] = pct(steady, 0.5)
            result["steady pass s (max)"] = max(steady)
    finally:
        server.should_exit = True
        await serving
        await engine.dispose()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--entities", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gets", type=int, default=1000)
    parser.add_argument("--controller", action="store_true", help="the controller's passes")
    parser.add_argument("--delay-ms", type=float, default=60.0, help="added to every call")
    args = parser.parse_args()
    print(f"# {platform.platform()}, python {platform.python_version()}")
    if args.controller:
        print(f"# controller: 4 url providers x 102 models, {args.delay_ms:g} ms per catalog call")
    else:
        print(f"# {args.entities} model entities + {args.entities} virtual models, page_size 1000")
    for backend in args.backends.split(","):
        postgres = PostgresDatabase() if backend == "postgresql" else None
        with tempfile.TemporaryDirectory() as tmp:
            url = postgres.url if postgres else f"sqlite:///{tmp}/catalog.db"
            run = controller_passes if args.controller else run_backend
            try:
                result = asyncio.run(run(url, args))
            finally:
                if postgres:
                    postgres.close()
        for key, value in result.items():
            print(f"{backend:10} {key:40} {value:8.3f}")


if __name__ == "__main__":
    main()
