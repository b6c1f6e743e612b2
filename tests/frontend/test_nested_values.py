"""One value nested far too deep (a card, an endpoint instance, a route) is skipped and counted
where it lies: discovery keeps streaming, the route watcher keeps watching, and a frontend
started beside it starts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from shoal.discovery import FleetTarget, ModelKey, Route, publish_route, route_key
from shoal.discovery.keys import instance_key
from shoal.frontend import Frontend
from shoal.frontend.virtual.routes import RouteWatcher
from shoal.frontend.virtual.virtual import RouteTable
from shoal.store import Store, open_store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import serving
from tests.helpers import wait_for
from tests.processes import Processes

DEEP = 1_000


def deep_json(document: dict[str, Any], field: str, depth: int = DEEP) -> bytes:
    """`document` with `field` set to an object nested `depth` deep (written by hand: the
    encoders refuse to go that deep)."""
    head = msgspec.json.encode(document)[:-1] + (b"," if document else b"")
    value = b'{"a":' * depth + b"1" + b"}" * depth
    return head + b'"' + field.encode() + b'":' + value + b"}"


async def health(frontend: Frontend) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        response = await session.get(f"{frontend.url}/health")
        return await response.json()  # type: ignore[no-any-return]


async def skipped_reasons(frontend: Frontend) -> dict[str, str]:
    return {entry["key"]: entry["reason"] for entry in (await health(frontend))["skipped"]}


async def test_models_registered_after_a_card_nested_1000_deep_are_served(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    first = await start_worker("first-llm")
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, "first-llm"))
    card = msgspec.json.decode(first.card().to_json())
    card["display_name"] = card["slug"] = "deep-llm"
    del card["runtime_config"]
    deep_key = ModelKey(first.endpoint, first.instance_id, "deep")
    await store.put(deep_key.key, deep_json(card, "runtime_config"))
    instance = msgspec.json.decode(msgspec.json.encode(first.info()))
    instance["instance_id"] = first.instance_id + 1
    await store.put(
        instance_key(first.endpoint, first.instance_id + 1), deep_json(instance, "extra")
    )

    reasons = await wait_for(
        lambda: _when(skipped_reasons(frontend), lambda r: len(r) == 2), message="both skipped"
    )
    assert all("nested deeper than 64 levels" in reason for reason in reasons.values()), reasons
    await start_worker("later-llm")  # registered after the bad values
    await wait_for(lambda: serving(frontend, "later-llm"), message="a later model is served")
    assert serving(frontend, "first-llm")
    # A frontend started now loads the same snapshot and serves, instead of blaming the store.
    fresh = await start_frontend(setup_timeout=5)
    await wait_for(lambda: serving(fresh, "later-llm") and serving(fresh, "first-llm"))
    assert deep_key.key in await skipped_reasons(fresh)
    await start_worker("third-llm")  # and its stream goes on carrying changes
    await wait_for(lambda: serving(fresh, "third-llm") and serving(frontend, "third-llm"))


async def _when(reasons: Any, check: Any) -> Any:
    value = await reasons
    return value if check(value) else None


async def test_a_route_nested_1000_deep_does_not_stop_shoal_frontend_starting(
    processes: Processes, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = await open_store(url)
    try:
        await publish_route(
            store, Route(workspace="default", name="fast", targets=(FleetTarget("mock-llm"),))
        )
        value = deep_json({"workspace": "default", "name": "deep"}, "unknown")
        assert len(value) < 8_000  # a few kB is all it takes
        await store.put(route_key("default", "deep"), value)
    finally:
        await store.close()
    front = await processes.start(
        "frontend", "--store", url, "--port", "0", "--cache-dir", str(tmp_path / "cache"),
        "--setup-timeout", "5", ready="frontend",
    )  # fmt: skip
    async with aiohttp.ClientSession() as session:
        body = await (await session.get(f"{front.url}/health")).json()
    (skipped,) = body["virtual_models"]["skipped"]
    assert skipped["key"] == route_key("default", "deep")
    assert "nested deeper than 64 levels" in skipped["reason"]
    assert [m["name"] for m in body["virtual_models"]["models"]] == ["fast"]


async def test_the_route_watcher_survives_a_read_whose_values_make_the_table_raise(
    store: Store, start_frontend: StartFrontend
) -> None:
    """Whatever a re-read's values make `replace` raise is retried like a failed read: it
    ends neither the start nor the workspace's watch task."""
    frontend = await start_frontend()
    table = RouteTable(frontend.registry, ("default",))
    failures = 1
    replace = table.replace

    async def failing_replace(*args: Any) -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise RecursionError("a value the table could not take")
        await replace(*args)

    table.replace = failing_replace  # type: ignore[method-assign]
    watcher = RouteWatcher(store, table)
    await publish_route(store, Route(workspace="default", name="a", targets=()))
    async with asyncio.timeout(10):
        await watcher.start()
    try:
        assert "a" in table.routes["default"]
        await publish_route(store, Route(workspace="default", name="b", targets=()))
        await wait_for(lambda: "b" in table.routes["default"])
    finally:
        await watcher.stop()
        table.close()
