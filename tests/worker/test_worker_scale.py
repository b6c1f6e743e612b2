"""A worker announcing many models holds its event loop a slice of them at a time: its
control loops (`lease`, `models`) count their work per turn of the loop against the code's
own slice constants, with the constant made small so a few hundred models span many turns."""

from __future__ import annotations

import asyncio
import gc
import sqlite3
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from shoal.cards import ModelCard, slugify
from shoal.discovery import Discovery, EndpointId, ModelKey
from shoal.store import MAX_VALUE_BYTES, Store, StoreUnavailableError, open_store, sqlite_log
from shoal.store import sqlite as sqlite_module
from shoal.worker import Engine, Runtime, ServedModel
from shoal.worker import adapters as adapters_module
from shoal.worker import endpoint as endpoint_module
from shoal.worker import registrations as registrations_module
from shoal.worker import runtime as runtime_module
from shoal.worker.registrations import DRAINING
from tests.helpers import LoopTurns, wait_for

EP = "ns.backend.generate"
SLICE = 64


class ManyAdapters(Engine):
    """An engine listing a base model and `count` adapters on it."""

    name = "many"

    def __init__(self, count: int) -> None:
        base = ServedModel(name="base", source="test://base")
        self.models = [base, *(_adapter(f"lora-{i:04d}") for i in range(count))]

    def app(self) -> web.Application:
        return web.Application()

    async def served_models(self) -> list[ServedModel]:
        return self.models


def _adapter(name: str) -> ServedModel:
    return ServedModel(name=name, source=f"test://{name}", adapter=name, base_model="base")


@pytest.fixture
async def observer(tmp_path: Path) -> AsyncIterator[Store]:
    store = await open_store(f"sqlite:///{tmp_path / 'store.db'}")
    yield store
    await store.close()


@pytest.fixture
async def runtime(tmp_path: Path, observer: Store) -> AsyncIterator[Runtime]:
    rt = Runtime(f"sqlite:///{tmp_path / 'store.db'}", lease_ttl=30, drain_timeout=0)
    await rt.start()
    yield rt
    await rt.drain(timeout=0)


async def _announced(observer: Store, count: int) -> bool:
    return len(await Discovery(observer).list()) == count


async def test_a_lease_loop_turn_compares_the_keys_it_holds_with_the_store_a_slice_per_turn(
    runtime: Runtime, observer: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was wrong: each turn of the lease loop (every TTL/3) compared every key of the
    process with its listing of the store in one turn of the event loop (20,000 adapters:
    one pass over all of them, every 3 s at the default TTL). What holds now: it compares
    `KEYS_PER_TURN` keys per turn, and a key deleted behind the worker's back is still put
    back."""
    monkeypatch.setattr(registrations_module, "KEYS_PER_TURN", SLICE, raising=False)
    adapters = 3 * SLICE + 7
    await runtime.endpoint(EP).serve(ManyAdapters(adapters))
    await wait_for(lambda: _announced(observer, adapters + 1), timeout=30, message="announced")
    registrations = runtime.registrations
    held = ModelKey(EndpointId.parse(EP), runtime.instance_id).key
    gone = (await observer.get_prefix(held + "/")).items[100].key
    await observer.delete(gone)

    compared = LoopTurns().wrap(registrations, "_is_missing")
    try:
        await registrations.renew()
    finally:
        await compared.stop()
    assert compared.on_loop >= adapters + 2  # every key: the instance's, the base's, adapters'
    assert compared.most_per_turn <= SLICE
    assert registrations.repairs == 1
    assert await observer.get(gone) is not None


async def test_the_collector_is_kept_off_what_the_worker_holds_after_a_large_change(
    tmp_path: Path, observer: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was wrong: a worker's 20,000 models are ~130,000 objects, and a full garbage
    collection over them, set off by the allocations of a change (an upstream listing
    1,000 adapters more or fewer, a store outage and re-registration), held the event loop
    90-210 ms (probed from outside). What holds now: with `freeze_collector` (what `shoal
    worker` sets) the runtime freezes what it holds out of full collections
    (`gc.freeze()`) after its first models, after `FREEZE_AFTER` models attached or
    detached, and after a re-registration under a new lease; not after a smaller change."""
    monkeypatch.setattr(runtime_module, "FREEZE_AFTER", SLICE, raising=False)
    frozen: list[int] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(len(frozen)))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    runtime = Runtime(url, lease_ttl=30, drain_timeout=0, freeze_collector=True)
    await runtime.start()
    try:
        engine = ManyAdapters(0)
        await runtime.endpoint(EP).serve(engine)
        engine.models = [*engine.models, *(_adapter(f"lora-{i}") for i in range(3 * SLICE))]
        await wait_for(lambda: frozen, timeout=10, message="frozen after a large change")
        assert len(frozen) == 1
        await wait_for(lambda: _announced(observer, 3 * SLICE + 1), timeout=10)

        engine.models = [*engine.models, *(_adapter(f"more-{i}") for i in range(SLICE // 2))]
        await wait_for(lambda: _announced(observer, 3 * SLICE + SLICE // 2 + 1), timeout=10)
        assert len(frozen) == 1  # (fewer than FREEZE_AFTER changes since)

        registrations = runtime.registrations
        first = registrations.lease_id
        assert first is not None
        await observer.revoke(first)
        await registrations.renew()  # (the lease loop's step, now: a new lease, every key put)
        assert registrations.lease_id not in (None, first)
        await wait_for(lambda: len(frozen) == 2, timeout=10, message="after re-registering")
    finally:
        await runtime.drain(timeout=0)


async def test_a_re_registration_after_a_lost_lease_puts_the_cards_in_batches(
    runtime: Runtime, observer: Store
) -> None:
    """What was wrong: a worker whose lease was lost put each of its cards back in a store
    call (and a SQLite transaction) of its own: 20,000 cards took 8-27 s, every model gone
    from the fleet meanwhile. What holds now: the cards go in `put_many` calls of
    `PUT_BATCH`, SQLite writing `PUT_MANY_KEYS` of them per transaction, one batch per turn
    of the event loop; every card is announced under the new lease."""
    adapters = 2000
    await runtime.endpoint(EP).serve(ManyAdapters(adapters))
    await wait_for(lambda: _announced(observer, adapters + 1), timeout=60, message="announced")
    registrations = runtime.registrations
    store = registrations.store
    first = registrations.lease_id
    assert first is not None
    await observer.revoke(first)

    calls = LoopTurns()
    for name in ("put", "create", "put_many"):
        calls.wrap(store, name)
    batches = LoopTurns().wrap(store, "put_many")
    moved = LoopTurns().wrap(registrations.metadata, "reassign")
    transactions = LoopTurns().wrap(sqlite_module, "_put_many")
    try:
        await registrations.renew()  # (the lease loop's step: a new lease, every key put)
    finally:
        for turns in (calls, batches, moved, transactions):
            await turns.stop()
    new = registrations.lease_id
    assert new not in (None, first)
    cards = adapters + 1
    per_batch = registrations_module.PUT_BATCH
    assert batches.on_loop == -(-cards // per_batch)
    assert calls.on_loop == batches.on_loop + 1  # (and the instance's own key)
    assert moved.on_loop == cards and moved.most_per_turn <= per_batch
    assert transactions.off_loop <= -(-cards // sqlite_log.PUT_MANY_KEYS) + 1
    listed = await Discovery(observer).list()
    assert len(listed) == cards
    assert {model.key.instance_id for model in listed} == {new}


async def test_a_first_attach_of_many_adapters_puts_their_cards_in_batches(
    runtime: Runtime, observer: Store
) -> None:
    """What was wrong: a worker's first attach of its engine's models made a store call
    (and a SQLite transaction) per card. What holds now: the cards of the models not yet
    attached go in `put_many` calls of `PUT_BATCH`; a card the store refuses (over its
    bound on a value) is refused alone, every other model is announced."""
    adapters = 2000
    engine = ManyAdapters(adapters)
    big = _adapter("lora-big")
    big.runtime_config["blob"] = "x" * MAX_VALUE_BYTES
    engine.models.insert(1500, big)
    store = runtime.registrations.store
    calls = LoopTurns()
    for name in ("put", "create", "put_many"):
        calls.wrap(store, name)
    batches = LoopTurns().wrap(store, "put_many")
    try:
        endpoint = runtime.endpoint(EP)
        await endpoint.serve(engine)
    finally:
        for turns in (calls, batches):
            await turns.stop()
    cards = adapters + 1
    assert batches.on_loop == -(-(cards + 1) // registrations_module.PUT_BATCH)
    assert calls.on_loop == batches.on_loop + 1  # (and the instance's own key)
    assert list(endpoint.refused) == ["lora-big"]
    assert "ValueTooLargeError" in endpoint.refused["lora-big"][1]
    assert len(endpoint.models) == cards
    assert await _announced(observer, cards)


async def test_tainting_many_models_puts_their_cards_in_batches(
    runtime: Runtime, observer: Store
) -> None:
    """What was wrong: a drain tainted each of a worker's cards with a store call (and a
    SQLite transaction) of its own, 20,000 for a sidecar's adapters. What holds now: the
    tainted cards go in `put_many` calls of `PUT_BATCH`; every card carries the taint."""
    adapters = 2000
    await runtime.endpoint(EP).serve(ManyAdapters(adapters))
    await wait_for(lambda: _announced(observer, adapters + 1), timeout=60, message="announced")
    store = runtime.registrations.store
    calls = LoopTurns()
    for name in ("put", "create", "put_many"):
        calls.wrap(store, name)
    batches = LoopTurns().wrap(store, "put_many")
    try:
        await runtime.endpoint(EP).set_taints(["maintenance"])
    finally:
        for turns in (calls, batches):
            await turns.stop()
    cards = adapters + 1
    assert batches.on_loop == -(-cards // registrations_module.PUT_BATCH)
    assert calls.on_loop == batches.on_loop
    listed = await Discovery(observer).list()
    assert len(listed) == cards
    assert {tuple(model.card.taints) for model in listed} == {("maintenance",)}


async def test_a_taint_cut_short_goes_on_where_it_stopped_when_tried_again(
    runtime: Runtime, observer: Store
) -> None:
    """What was wrong: a drain gives `set_taints` 1.5 s, then 1 s per retry, and every try
    put every card again from the first: SQLite writing ~10,000 keys/s, 20,000 cards never
    all carried `draining` (stuck at 12,788) and frontends kept routing to the others. What
    holds now: a try puts only the cards not yet put with those taints, so a retry goes on
    where the try cut short stopped, and a try with nothing left to taint puts nothing."""
    adapters = 2000
    endpoint = runtime.endpoint(EP)
    await endpoint.serve(ManyAdapters(adapters))
    await wait_for(lambda: _announced(observer, adapters + 1), timeout=60, message="announced")
    store = runtime.registrations.store
    put_many = store.put_many
    calls: list[int] = []
    never = asyncio.Event()

    async def held_at_the_second_batch(
        items: Sequence[tuple[str, bytes]], *, lease: int = 0
    ) -> int:
        calls.append(len(items))
        if len(calls) == 2:
            await never.wait()  # (the drain's timeout cuts the try here)
        return await put_many(items, lease=lease)

    store.put_many = held_at_the_second_batch  # type: ignore[method-assign]
    tainting = asyncio.create_task(endpoint.set_taints([DRAINING]))
    await wait_for(lambda: len(calls) == 2, timeout=30, message="the second batch begun")
    tainting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await tainting
    store.put_many = put_many  # type: ignore[method-assign]

    cards = adapters + 1
    for left in (cards - registrations_module.PUT_BATCH, 0):
        keys = LoopTurns().wrap(store, "put_many", lambda items, **_: len(items))
        try:
            await endpoint.set_taints([DRAINING])
        finally:
            await keys.stop()
        assert keys.on_loop == left
    listed = await Discovery(observer).list()
    assert len(listed) == cards
    assert {tuple(model.card.taints) for model in listed} == {(DRAINING,)}


async def test_cards_an_attach_many_wrote_before_the_store_failed_are_withdrawn(
    runtime: Runtime, observer: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was wrong: when the store failed half-way through an `attach_many` (SQLite's
    "database is locked" on its 2nd transaction), the cards of the transactions before
    stayed announced under the live lease, while the worker held none of those models and
    `lease_problem()` said nothing, until the lease ended. What holds now: their keys are
    withdrawals pending, so the next lease-loop turn withdraws them (and a retry attaches
    each model again)."""
    registrations = runtime.registrations
    endpoint = EndpointId.parse("ns.other.generate")  # (not served: no models loop)
    await registrations.register_instance(endpoint, "http://127.0.0.1:9", "http://127.0.0.1:9")
    per_transaction = sqlite_log.PUT_MANY_KEYS
    entries = [(_card(f"lora-{i}"), f"lora-{i}", {}, None) for i in range(2 * per_transaction + 10)]
    put_many = sqlite_module._put_many
    transactions: list[int] = []

    def locked_at_the_second(*args: object, **kwargs: object) -> object:
        transactions.append(1)
        if len(transactions) == 2:
            raise sqlite3.OperationalError("database is locked")
        return put_many(*args, **kwargs)

    monkeypatch.setattr(sqlite_module, "_put_many", locked_at_the_second)
    with pytest.raises(StoreUnavailableError):
        await registrations.attach_many(endpoint, entries)
    monkeypatch.setattr(sqlite_module, "_put_many", put_many)
    cards = ModelKey(endpoint, registrations.instance_id).key + "/"
    assert len((await observer.get_prefix(cards)).items) == per_transaction  # (written)

    await registrations.renew()
    assert registrations.models_of(endpoint) == {}
    assert (await observer.get_prefix(cards)).items == []
    assert registrations.lease_problem() is None
    assert await registrations.attach_many(endpoint, entries) == ({}, set())  # (tried again)
    assert len((await observer.get_prefix(cards)).items) == len(entries)


def _card(name: str) -> ModelCard:
    return ModelCard.build(
        display_name=name,
        slug=slugify(name),
        source="test://x",
        model_types=["chat"],
        context_length=4096,
    )


async def test_the_adapter_listing_describes_a_slice_of_them_per_turn_of_the_loop(
    runtime: Runtime, observer: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was wrong: `GET /v1/loras` (no token needed) described every adapter, its card's
    mdcsum computed, and encoded them in one turn of the event loop: 20,000 adapters held a
    worker's loop 233 ms per call, its requests' streams with it. What holds now: at most
    `LISTED_PER_TURN` are described per turn, and the listing is whole."""
    monkeypatch.setattr(adapters_module, "LISTED_PER_TURN", SLICE, raising=False)
    adapters = 3 * SLICE + 7
    await runtime.endpoint(EP).serve(ManyAdapters(adapters))
    described = LoopTurns().wrap(adapters_module, "_lora_body")
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(runtime.status_url + "/v1/loras") as resp,
        ):
            assert resp.status == 200
            listing = await resp.json()
    finally:
        await described.stop()
    assert described.on_loop == adapters
    assert described.most_per_turn <= SLICE, f"{described.most_per_turn} in one turn"
    data = listing["data"]
    assert listing["object"] == "list" and len(data) == adapters
    first = runtime.endpoint(EP).models["lora-0000"]
    assert data[0] == {
        "object": "lora",
        "name": "lora-0000",
        "suffix": "lora-0000",
        "endpoint": EP,
        "base_model": "base",
        "mdcsum": first.card.mdcsum,
    }
    assert sorted(entry["name"] for entry in data) == [f"lora-{i:04d}" for i in range(adapters)]


async def test_cards_deleted_behind_the_workers_back_are_put_back_in_batches(
    runtime: Runtime, observer: Store, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """What was wrong: cards the store lost (`etcdctl del --prefix`, a restored backup) were
    put back a store call each (a create, and a read and a put where it failed), logging a
    warning each: 8,000 took 8 s on etcd, 3,404 warnings. What holds now: they go back in
    `put_many` calls of `PUT_BATCH`, one warning a turn names how many."""
    monkeypatch.setattr(registrations_module, "PUT_BATCH", SLICE)
    adapters = 3 * SLICE + 7
    await runtime.endpoint(EP).serve(ManyAdapters(adapters))
    await wait_for(lambda: _announced(observer, adapters + 1), timeout=30, message="announced")
    registrations = runtime.registrations
    lease = registrations.lease_id
    assert lease is not None
    prefix = ModelKey(EndpointId.parse(EP), lease).key
    for kv in (await observer.get_prefix(prefix)).items:
        await observer.delete(kv.key)

    store = registrations.store
    calls = LoopTurns()
    for name in ("put", "create", "put_many"):
        calls.wrap(store, name)
    batches = LoopTurns().wrap(store, "put_many")
    caplog.clear()
    try:
        await registrations.renew()
    finally:
        await calls.stop()
        await batches.stop()
    cards = adapters + 1
    assert batches.on_loop == -(-cards // SLICE) and calls.on_loop == batches.on_loop
    assert batches.most_per_turn == 1
    assert registrations.repairs == cards and registrations.lease_problem() is None
    assert registrations.lease_id == lease
    listed = await Discovery(observer).list()
    assert len(listed) == cards and {m.key.instance_id for m in listed} == {lease}
    warnings = [r for r in caplog.records if "missing from the store" in r.getMessage()]
    assert len(warnings) == 1 and f"{cards} registrations" in warnings[0].getMessage()


async def test_models_the_engine_no_longer_lists_are_withdrawn_in_batches(
    runtime: Runtime, observer: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was wrong: each model the engine stopped listing was withdrawn in a store call
    (a SQLite transaction) of its own, holding the registrations' lock: an upstream dropping
    20,000 adapters took 5.0 s from the first withdrawal to the last, the rest announced,
    routed to and answered 404 meanwhile. What holds now: they go in `Store.delete_many`
    calls of `PUT_BATCH` (1.3 s), and their metadata files with them."""
    monkeypatch.setattr(registrations_module, "PUT_BATCH", SLICE)
    monkeypatch.setattr(endpoint_module, "PUT_BATCH", SLICE)
    adapters = 3 * SLICE + 7
    engine = ManyAdapters(adapters)
    endpoint = runtime.endpoint(EP)
    await endpoint.serve(engine)
    await wait_for(lambda: _announced(observer, adapters + 1), timeout=30, message="announced")
    store = runtime.registrations.store
    calls = LoopTurns()
    for name in ("delete", "delete_many"):
        calls.wrap(store, name)
    batches = LoopTurns().wrap(store, "delete_many")
    try:
        engine.models = engine.models[:1]  # (the base model only)
        await wait_for(lambda: _announced(observer, 1), timeout=30, message="withdrawn")
    finally:
        await calls.stop()
        await batches.stop()
    assert batches.on_loop == -(-adapters // SLICE) and calls.on_loop == batches.on_loop
    assert list(endpoint.models) == [None]
    assert len(runtime.metadata) == 0  # (ManyAdapters hosts no files: none left either)
