"""What a fleet costs the readers of discovery (`shoal.discovery.join`): readers of one query
hold one copy of each value, the cards of a model share what they repeat without changing
what they say, and a listing stays in key order as the fleet changes without being sorted
again whole."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest

from shoal.cards import MetadataFile, ModelCard
from shoal.discovery import Discovery, EndpointId, ModelKey, Query, join
from shoal.store import Store, open_store
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
