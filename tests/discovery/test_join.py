"""What a fleet costs the readers of discovery (`shoal.discovery.join`): readers of one query
hold one copy of each value, the cards of a model share what they repeat without changing
what they say, and a listing stays in key order as the fleet changes without being sorted
again whole."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from shoal.cards import MetadataFile, ModelCard
from shoal.discovery import Discovery, EndpointId, ModelKey, Query, join, service, values
from shoal.store import KeyRevision, Store, open_store
from shoal.store.sqlite import SQLiteStore
from tests.discovery.test_discovery import EP, Watch, info, make_card, register
from tests.helpers import wait_for

SUM_A = "sha256:" + "a" * 64
SUM_B = "sha256:" + "b" * 64


def card_at(instance_id: int, name: str = "shared", checksum: str = SUM_A) -> ModelCard:
    """A card of `name` whose file URL is its instance's own, as a worker's would be."""
    files = {"config.json": MetadataFile(f"http://10.0.0.{instance_id}:8/config", checksum, 10)}
    return make_card(name, metadata_files=files, context_length=8192)


@pytest.fixture
async def store() -> AsyncIterator[Store]:
    s = await open_store(f"memory://{uuid.uuid4().hex}")
    yield s
    await s.close()


async def test_the_listing_and_the_stream_of_a_query_hold_one_copy_of_each_value(
    store: Store,
) -> None:
    disc = Discovery(store)
    keys = [await register(disc, EP, 0x20 + i, card_at(i)) for i in range(3)]
    watch = Watch(disc)
    try:
        await wait_for(lambda: watch.live() == set(keys))
        listed = await disc.list()
        [stream] = [r for r in disc._readers[Query()] if r is not disc._listed[Query()]]
        lister = disc._listed[Query()]
        for model in listed:
            for kv_key in (model.key.key, model.key.instance_key):
                assert lister.held[kv_key] is stream.held[kv_key]  # parsed once, held once
                # ... and the key string itself is one object in both readers' indexes
                [mine] = [k for k in lister.held if k == kv_key]
                [theirs] = [k for k in stream.held if k == kv_key]
                assert mine is theirs
            assert stream.reported[model.key] is model
    finally:
        await watch.close()


async def test_cards_of_one_model_share_what_they_repeat_and_say_what_they_said(
    store: Store,
) -> None:
    disc = Discovery(store)
    written = {i: card_at(i) for i in range(3)}
    written[3] = card_at(3, checksum=SUM_B)  # same name, another version of a file
    written[4] = card_at(4).with_taints(["draining"])
    for i, card in written.items():
        await register(disc, EP, 0x40 + i, card)
    listed = {m.key.instance_id - 0x40: m for m in await disc.list()}
    for i, card in written.items():
        assert listed[i].card == card  # shared parts never change what a card says
        assert listed[i].mdcsum == card.mdcsum
    first, second = listed[0].card, listed[1].card
    assert first.model_types is second.model_types
    assert first.runtime_config is second.runtime_config
    assert first.context_length is second.context_length
    [(name_a, file_a)] = first.metadata_files.items()
    [(name_b, file_b)] = second.metadata_files.items()
    assert name_a is name_b and file_a.checksum is file_b.checksum
    assert file_a.url != file_b.url  # what differs per instance is its own
    assert listed[0].mdcsum is listed[1].mdcsum
    assert listed[3].mdcsum != listed[0].mdcsum


@pytest.mark.parametrize("resort_after", [join.RESORT_AFTER, 1])
async def test_a_listing_stays_in_key_order_as_the_fleet_changes(
    store: Store, monkeypatch: pytest.MonkeyPatch, resort_after: int
) -> None:
    """Between two listings models arrive, leave and change: each listing is in key order
    (store order) and complete, whether the moved models are put in place one by one or,
    past `RESORT_AFTER` of them, the listing is sorted again whole."""
    monkeypatch.setattr(join, "RESORT_AFTER", resort_after)
    disc = Discovery(store)
    other = EndpointId("prod", "backend", "other")
    keys = [await register(disc, EP, i, make_card()) for i in (0x2, 0x10, 0x30, 0xA)]
    first = await disc.list()
    assert [m.key for m in first] == sorted(keys, key=ModelKey.sort_key)
    keys.append(await register(disc, EP, 0x11, make_card()))  # between two listed ones
    keys.append(await register(disc, other, 0x1, make_card()))  # after all of them
    keys.append(await register(disc, EP, 0x10, make_card("adapter"), suffix="lora"))
    await disc.unregister_model(keys[2])  # 0x30
    await disc.update_taints(keys[0], ["draining"])
    second = await disc.list()
    expected = sorted([k for k in keys if k != keys[2]], key=ModelKey.sort_key)
    assert [m.key for m in second] == expected
    assert [m.key.key for m in second] == sorted(m.key.key for m in second)
    assert {m.key: m for m in second}[keys[0]].card.taints == ("draining",)
    third = await disc.list()
    assert [m.key for m in third] == expected


async def test_an_instance_record_holds_its_names_once_for_the_fleet(store: Store) -> None:
    disc = Discovery(store)
    for i in range(2):
        raw = msgspec.json.encode(info(EP, 0x60 + i))
        await store.put(f"shoal/v1/instances/{EP.path}/{0x60 + i:x}", raw)
    first, second = await disc.list_instances()
    assert first.namespace is second.namespace and first.component is second.component


# -- listings that leave out the values unchanged since the last one -------------------------


class Reads:
    """The reads asked of a store, by method (`get_prefixes_changed` with its `since`; not
    the calls a backend makes of its own methods)."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, object]] = []
        self._depth = 0
        for name in ("get", "get_prefixes", "get_prefixes_changed"):
            method = getattr(store, name)

            async def counted(
                *args: Any, _method: Any = method, _name: str = name, **kwargs: Any
            ) -> Any:
                if not self._depth:
                    since = _name == "get_prefixes_changed"
                    self.calls.append((_name, args[1] if since else args[0]))
                self._depth += 1
                try:
                    return await _method(*args, **kwargs)
                finally:
                    self._depth -= 1

            monkeypatch.setattr(store, name, counted)

    def take(self) -> list[tuple[str, object]]:
        calls, self.calls = self.calls, []
        return calls


async def test_a_listing_reads_only_the_values_changed_since_the_last_one(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    disc = Discovery(store)
    keys = [await register(disc, EP, 0x60 + i, card_at(i)) for i in range(3)]
    reads = Reads(store, monkeypatch)
    first = await disc.list()
    assert reads.take() == [("get_prefixes_changed", 0)]  # a first listing: every value
    revision = disc._listed_at[Query()]
    tainted = await disc.update_taints(keys[1], ["draining"])
    reads.take()
    second = await disc.list()
    assert reads.take() == [("get_prefixes_changed", revision)]  # nothing read one by one
    assert [m.card for m in second] == [first[0].card, tainted, first[2].card]
    assert second[0] is first[0] and second[2] is first[2]
    assert second == await Discovery(store).list()  # what a reader reading everything lists


async def test_a_malformed_value_left_out_of_a_listing_is_read_and_reported_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value skipped as malformed is not held: a listing that leaves it out (unchanged)
    reads it again, so it is reported and counted on every listing as before, and listed
    as skipped; once fixed it is listed."""
    disc = Discovery(store)
    good = await register(disc, EP, 0x70, card_at(0))
    bad = ModelKey(EP, 0x71)
    await disc.register_instance(info(EP, 0x71), lease=0)
    await store.put(bad.key, b"{not json")
    assert [m.key for m in await disc.list()] == [good]
    reads = Reads(store, monkeypatch)
    counted = values.MALFORMED.labels("model")._value.get()
    assert [m.key for m in await disc.list()] == [good]
    assert reads.take() == [("get_prefixes_changed", disc._listed_at[Query()]), ("get", bad.key)]
    assert values.MALFORMED.labels("model")._value.get() == counted + 1
    assert bad.key in disc.skipped
    await store.put(bad.key, card_at(1).to_json())
    assert [m.key for m in await disc.list()] == [good, bad]
    assert bad.key not in disc.skipped


async def test_an_ignored_change_left_out_of_a_listing_keeps_the_registered_card(
    store: Store,
) -> None:
    """A change ignored is held as the card it changed (at an older revision): a listing
    that leaves the changed value out reads it, ignores it again, and keeps the card."""
    disc = Discovery(store)
    key = await register(disc, EP, 0x80, card_at(0))
    await disc.list()
    await store.put(key.key, card_at(0, name="another").to_json())
    for _ in range(2):  # the value sent, then left out
        [listed] = await disc.list()
        assert listed.card.display_name == "shared"
        assert disc.skipped.get(key.key) == join.IGNORED


async def test_a_value_left_out_that_changed_before_it_was_read_is_listed_again_whole(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value read alone is the listed one only if its key still has the listed revision;
    if it moved on meanwhile, the query is listed again with every value, at one revision."""
    disc = Discovery(store)
    good = await register(disc, EP, 0x90, card_at(0))
    bad = ModelKey(EP, 0x91)
    await disc.register_instance(info(EP, 0x91), lease=0)
    await store.put(bad.key, b"{not json")
    await disc.list()
    get = store.get

    async def changed_first(key: str) -> Any:
        if key == bad.key:  # the key is written between the listing and this read
            await store.put(bad.key, card_at(1).to_json())
        return await get(key)

    monkeypatch.setattr(store, "get", changed_first)
    reads = Reads(store, monkeypatch)
    assert [m.key for m in await disc.list()] == [good, bad]
    assert [name for name, _ in reads.take()] == ["get_prefixes_changed", "get", "get_prefixes"]
    assert bad.key not in disc.skipped
    assert disc._listed_at[Query()] == (await store.get_prefix("")).revision


async def test_a_reader_takes_a_value_left_out_from_a_peer_at_its_revision_or_asks_for_it(
    store: Store,
) -> None:
    """A key listed without its value is taken as held only from a reader (itself or a
    peer) that holds it at exactly the listed revisions; any other is returned as needed,
    and nothing held is dropped because its value was left out."""
    disc = Discovery(store)
    keys = [await register(disc, EP, 0xA0 + i, card_at(i)) for i in range(2)]
    full = await store.get_prefixes((Query().instances_prefix, Query().models_prefix))
    peers: weakref.WeakSet[join.CardsAndInstances] = weakref.WeakSet()
    reading = join.CardsAndInstances({}, peers)
    await reading.replace_all(Query(), full.items)
    listing = await store.get_prefixes_changed(
        (Query().instances_prefix, Query().models_prefix), full.revision
    )
    assert all(isinstance(kv, KeyRevision) for kv in listing.items)
    # A peer of `reading` shares what it holds, never parsing a value.
    peer = join.CardsAndInstances({}, peers)
    needed: list[KeyRevision] = []
    touched = await peer.replace_all(Query(), listing.items, needed=needed)
    assert needed == []
    assert peer.held.keys() == reading.held.keys()
    assert all(peer.held[k] is reading.held[k] for k in reading.held)
    await peer.catch_up(touched)
    assert [m.key for m in peer.listing()] == keys
    # A reader with no peer, which never read these values, asks for every one.
    alone = join.CardsAndInstances({})
    assert await alone.replace_all(Query(), listing.items, needed=needed) == []
    assert [kv.key for kv in needed] == [kv.key for kv in listing.items]
    # A reader holding a key at another revision keeps it until the value comes.
    await disc.update_taints(keys[0], ["draining"])
    later = await store.get_prefixes_changed(
        (Query().instances_prefix, Query().models_prefix), (await store.get_prefix("")).revision
    )
    needed = []
    assert await reading.replace_all(Query(), later.items, needed=needed) == []
    assert [kv.key for kv in needed] == [keys[0].key]
    assert not reading.held[keys[0].key].card.taints  # (not dropped, not changed)


async def test_a_listing_reads_every_value_again_once_in_a_while(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `WHOLE_LISTING_EVERY` since the last listing of every value, the next one
    lists every value again (what a delta cannot see: a store restored from a backup)."""
    disc = Discovery(store)
    await register(disc, EP, 0x70, card_at(0))
    reads = Reads(store, monkeypatch)
    await disc.list()
    assert reads.take() == [("get_prefixes_changed", 0)]
    await disc.list()
    assert reads.take() == [("get_prefixes_changed", disc._listed_at[Query()])]
    monkeypatch.setattr(service, "WHOLE_LISTING_EVERY", 0.0)
    await disc.list()
    assert reads.take() == [("get_prefixes_changed", 0)]
    monkeypatch.setattr(service, "WHOLE_LISTING_EVERY", 3600.0)
    await disc.list()
    assert reads.take() == [("get_prefixes_changed", disc._listed_at[Query()])]


async def test_a_delta_that_removes_a_whole_fleet_lets_the_event_loop_run(store: Store) -> None:
    """Every key of a fleet gone in one delta (its lease expired, seen by a reader that
    cannot reap it): removed `LIST_BATCH` keys at a time, the loop running between."""
    disc = Discovery(store)
    for i in range(3 * join.LIST_BATCH):
        await register(disc, EP, 0x1000 + i, card_at(i % 250))
    full = await store.get_prefixes((Query().instances_prefix, Query().models_prefix))
    reading = join.CardsAndInstances({})
    await reading.replace_all(Query(), full.items)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    before = ticks
    await reading.apply_changes([], [kv.key for kv in full.items])
    ticker.cancel()
    assert reading.held == {}
    assert ticks - before >= len(full.items) // join.LIST_BATCH


@pytest.mark.parametrize("kind", ["memory", "sqlite", "sqlite, its log trimmed"])
async def test_a_listing_since_the_last_one_lists_what_a_new_reader_lists(
    kind: str, tmp_path: Path
) -> None:
    """Whole (memory; SQLite past its change log) or a delta from the change log (SQLite),
    a listing that starts from the last one ends where a reader reading everything does:
    through new cards and instances, taints, a card gone, an instance gone with its cards,
    a registration made again under a new lease, one that ended with its lease."""
    url = f"memory://{uuid.uuid4().hex}" if kind == "memory" else f"sqlite:///{tmp_path}/d.db"
    store = await open_store(url)
    try:
        disc = Discovery(store)
        keys = [await register(disc, EP, 0xB0 + i, card_at(i)) for i in range(6)]
        lease = await store.grant(60.0, keepalive=False)
        leased = ModelKey(EP, 0xC0)
        await disc.register_instance(info(EP, 0xC0), lease=lease.id)
        await disc.register_model(leased, card_at(0xC0), lease=lease.id)
        assert len(await disc.list()) == 7
        await disc.update_taints(keys[0], ["draining"])
        await disc.unregister_model(keys[1])
        await disc.unregister_instance(EP, keys[2].instance_id)  # (its card stays, unjoined)
        await disc.unregister_model(keys[3])
        await disc.register_model(keys[3], card_at(3, name="again"), lease=0)
        await lease.revoke()
        keys.append(await register(disc, EP, 0xD0, card_at(0xD0)))
        if kind == "sqlite, its log trimmed":
            assert isinstance(store, SQLiteStore)
            with sqlite3.connect(store.path) as conn:
                conn.execute("DELETE FROM changes")
                conn.execute("UPDATE meta SET compact_revision = revision WHERE id = 0")
        listed = await disc.list()
        assert listed == await Discovery(store).list()
        assert [m.key for m in listed] == [keys[0], keys[3], keys[4], keys[5], keys[6]]
        assert listed[0].card.taints == ("draining",)
        assert listed[1].card.display_name == "again"
        assert await disc.list() == listed  # and again, with nothing changed
    finally:
        await store.close()


async def test_a_value_over_the_stores_bound_written_by_an_outside_writer_is_skipped_unread(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store takes values of at most `MAX_VALUE_BYTES`; another writer (another language's
    worker, an etcd with a larger request limit) may put more. Such a card or instance is
    skipped and counted before it is parsed (a 40 MB card was decoded on the event loop,
    510 ms, and served)."""
    from shoal.store import base

    disc = Discovery(store)
    good = await register(disc, EP, 0x80, card_at(0))
    big = ModelKey(EP, 0x81)
    await disc.register_instance(info(EP, 0x81), lease=0)
    card = msgspec.json.decode(card_at(1).to_json())
    card["padding"] = "x" * base.MAX_VALUE_BYTES  # (valid, but for its size)
    monkeypatch.setattr(base, "MAX_VALUE_BYTES", 4 * base.MAX_VALUE_BYTES)  # (the outsider)
    await store.put(big.key, msgspec.json.encode(card))
    counted = values.MALFORMED.labels("model")._value.get()
    assert [m.key for m in await disc.list()] == [good]
    assert values.MALFORMED.labels("model")._value.get() == counted + 1
    assert "bytes" in disc.skipped[big.key]
