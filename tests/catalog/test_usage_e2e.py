"""Usage end to end, on SQLite and PostgreSQL: a frontend with `--auth keys` counts what three
keys spent on two models, flushes it to the catalog, keeps a backlog while the catalog is
restarted, and the catalog's sums equal what the clients saw."""

from __future__ import annotations

import asyncio
import collections
import json
import uuid
from pathlib import Path

import aiohttp

from shoal.catalog import CatalogClient, CatalogConfig, CatalogServer
from shoal.discovery import Discovery
from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend import Frontend, FrontendConfig
from shoal.store import open_store
from tests.frontend.support import FakeWorker
from tests.helpers import free_port, wait_for

KEYS = {f"key-{i}": f"sk-shoal-{i}" + "x" * 42 for i in range(3)}
MODELS = ("chat-a", "chat-b")


async def test_usage_equals_what_clients_saw_across_a_catalog_restart(
    database_url: str, tmp_path: Path
) -> None:
    store = await open_store(f"memory://{uuid.uuid4().hex}")
    workers = [await FakeWorker(model).start() for model in MODELS]
    port = free_port()
    catalog = CatalogServer(CatalogConfig(database_url, port=port))
    await catalog.start()
    frontend = Frontend(
        FrontendConfig(
            port=0, auth="keys", workspaces=("team-a",), catalog_url=catalog.url,
            usage_interval=0.1, cache_dir=tmp_path / "cache",
        ),
        discovery=Discovery(store),
    )  # fmt: skip
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    try:
        for worker in workers:
            await worker.register(store)
        for name, secret in KEYS.items():
            grant = Grant(workspace="team-a", name=name, hash=hash_secret(secret))
            await store.put(grant.key, grant.to_json())
        await frontend.start()
        await wait_for(lambda: all(m in frontend.registry.models for m in MODELS))
        await wait_for(lambda: frontend.keys is not None and len(frontend.keys.by_hash) == 3)

        async def send(session: aiohttp.ClientSession, i: int) -> None:
            name, model = f"key-{i % 3}", MODELS[i % 2]
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            headers = {"authorization": f"Bearer {KEYS[name]}"}
            url = f"{frontend.url}/v1/chat/completions"
            async with session.post(url, data=json.dumps(body), headers=headers) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
                seen[(name, model)] += 1
                assert answer["usage"]["completion_tokens"] == 3

        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(send(session, i) for i in range(150)))
            await catalog.stop()  # the catalog restarts in the middle
            await asyncio.gather(*(send(session, i) for i in range(150, 300)))
            assert frontend.usage is not None
            await wait_for(lambda: bool(frontend.usage.pending))  # type: ignore[union-attr]
            assert frontend.health()[1]["usage"]["last_error"]
            catalog = CatalogServer(CatalogConfig(database_url, port=port))
            await catalog.start()
            await wait_for(
                lambda: not frontend.usage.pending and not frontend.usage.rows, timeout=10
            )  # type: ignore[union-attr]

        async with CatalogClient(catalog.url, workspace="team-a") as client:
            by_key = {i["key"]: i for i in await client.usage(group_by="key")}
            for name in KEYS:
                requests = sum(n for (k, _), n in seen.items() if k == name)
                assert by_key[name]["requests"] == requests
                assert by_key[name]["total_tokens"] == 4 * requests  # 1 prompt + 3 completion
            for model in MODELS:
                got = await client.usage(group_by="model", model=model)
                assert got[0]["requests"] == sum(n for (_, m), n in seen.items() if m == model)
        assert sum(seen.values()) == 300
    finally:
        await frontend.stop()
        await catalog.stop()
        for worker in workers:
            await worker.stop()
        await store.close()
