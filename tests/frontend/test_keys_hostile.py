"""`--auth keys` against hostile grants in the store: one bad value affects only itself."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from shoal.discovery.grants import Grant, grant_key, hash_secret
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.test_keys import OTHER, SECRET, chat, grant
from tests.helpers import wait_for


def deep_grant(hash_: str, depth: int = 1_000) -> bytes:
    """A grant whose unknown field nests `depth` deep (by hand: encoders refuse)."""
    head = Grant(workspace="default", name="deep", hash=hash_).to_json()[:-1]
    return head + b',"extra":' + b"[" * depth + b"]" * depth + b"}"


async def test_a_grant_nested_1000_deep_neither_stops_the_start_nor_the_watch(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    await grant(store, SECRET)
    deep = grant_key("default", "c" * 64)
    await store.put(deep, deep_grant("c" * 64))
    async with asyncio.timeout(10):
        frontend = await start_frontend(auth="keys")
    await wait_for(lambda: "mock-llm" in frontend.registry.models)
    assert await chat(frontend, SECRET)
    assert frontend.keys is not None and "nested deeper" in frontend.keys.skipped[deep]
    await store.put(deep, deep_grant("c" * 64))  # arrives on the watch, too
    await grant(store, OTHER)  # and the watch goes on
    await wait_for(lambda: hash_secret(OTHER) in frontend.keys.by_hash)  # type: ignore[union-attr]
    assert await chat(frontend, OTHER)


async def test_a_grant_with_100000_models_is_skipped_not_held(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """The catalog allows 1,000 models a key; a grant naming more is refused by the
    frontend (every request of the key would scan them)."""
    await start_worker("mock-llm")
    await grant(store, SECRET)
    wide = Grant(
        workspace="default", name="wide", hash=hash_secret(OTHER),
        models=tuple(f"m{n}" for n in range(100_000)),
    )  # fmt: skip
    await store.put(wide.key, msgspec.json.encode(wide))
    frontend = await start_frontend(auth="keys")
    await wait_for(lambda: "mock-llm" in frontend.registry.models)
    assert frontend.keys is not None and wide.key in frontend.keys.skipped
    assert hash_secret(OTHER) not in frontend.keys.by_hash
    assert await chat(frontend, SECRET)


async def test_reloading_100000_grants_decodes_a_slice_of_them_per_turn_of_the_loop() -> None:
    """A workspace of 100,000 keys is read at the start and again after every broken watch
    or `Resync`: decoding them all in one go held the loop 0.9 s. Counted, not timed: the
    grants decoded in one turn of the loop are a `SLICE` at most."""
    from shoal.frontend.keys.keys import SLICE, KeyRing
    from shoal.store import KeyValue
    from tests.helpers import LoopTurns

    grants = [
        Grant(workspace="default", name=f"k{n}", hash=hash_secret(f"s{n}"), rpm=100)
        for n in range(100_000)
    ]
    items = [KeyValue(g.key, g.to_json(), 1) for g in grants]
    ring = KeyRing(["default"])
    decoded = LoopTurns().wrap(ring, "put")
    try:
        await ring.replace("default", items)  # the first read
        await ring.replace("default", items[1:])  # a re-read: one key gone
    finally:
        await decoded.stop()
    assert len(ring.by_hash) == 99_999 and grants[0].hash not in ring.by_hash
    assert decoded.on_loop == 100_000 + 99_999
    assert decoded.most_per_turn <= SLICE, f"{decoded.most_per_turn} grants in one turn"


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_a_burst_of_grant_events_decodes_a_slice_of_them_per_turn_of_the_loop(
    store: Store,
) -> None:
    """The key watch applied every event a store handed over in one go (a batch comes
    without a wait: the controller publishing a workspace's keys at once): 20,000 grants
    decoded in one turn of the loop. Now a `SLICE` at most, as a re-read does."""
    from shoal.frontend.keys.keys import SLICE, KeyRing, KeyWatcher
    from tests.helpers import LoopTurns

    grants = [
        Grant(workspace="default", name=f"k{n}", hash=hash_secret(f"s{n}"), rpm=100)
        for n in range(20_000)
    ]
    ring = KeyRing(["default"])
    watcher = KeyWatcher(store, ring)
    await watcher.start()
    decoded = LoopTurns().wrap(ring, "put")
    try:
        await store.put_many([(g.key, g.to_json()) for g in grants])
        await wait_for(lambda: len(ring.by_hash) == len(grants), timeout=30)
    finally:
        await decoded.stop()
        await watcher.stop()
    assert decoded.most_per_turn <= SLICE, f"{decoded.most_per_turn} grants in one turn"
