"""Catalog benchmark (not a test): 10,000 model entities and 10,000 virtual models in one
workspace; a full paginated list of each, and single gets, through the HTTP API.

    .venv/bin/python -m bench.catalog [--backends sqlite,postgresql] [--entities 10000]

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

from tests.helpers import free_port
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--entities", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gets", type=int, default=1000)
    args = parser.parse_args()
    print(f"# {platform.platform()}, python {platform.python_version()}")
    print(f"# {args.entities} model entities + {args.entities} virtual models, page_size 1000")
    for backend in args.backends.split(","):
        postgres = PostgresDatabase() if backend == "postgresql" else None
        with tempfile.TemporaryDirectory() as tmp:
            url = postgres.url if postgres else f"sqlite:///{tmp}/catalog.db"
            try:
                result = asyncio.run(run_backend(url, args))
            finally:
                if postgres:
                    postgres.close()
        for key, value in result.items():
            print(f"{backend:10} {key:40} {value:8.3f}")


if __name__ == "__main__":
    main()
