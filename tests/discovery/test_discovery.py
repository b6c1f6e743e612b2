"""Discovery over the store: the join of cards and instances, gap-free watches, bad values."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

import msgspec
import pytest

from shoal.cards import ModelCard, slugify
from shoal.discovery import (
    Added,
    Discovery,
    DiscoveryEvent,
    EndpointId,
    InstanceInfo,
    ModelConflictError,
    ModelKey,
    Query,
    Removed,
    TaintsUpdated,
    join,
    keys,
    service,
    values,
)
from shoal.discovery.values import MALFORMED
from shoal.store import Event, Snapshot, Store, memory, open_store
from tests.helpers import Collector, LoopTurns, wait_for
from tests.store.conftest import Backend

EP = EndpointId("prod", "backend", "generate")


def make_card(name: str = "llama", **extra: object) -> ModelCard:
    fields: dict[str, object] = {"context_length": 4096, **extra}
    return ModelCard.build(
        display_name=name, slug=slugify(name), source=f"hf://{name}", model_types=["chat"], **fields
    )


def info(endpoint: EndpointId, instance_id: int) -> InstanceInfo:
    return InstanceInfo(
        namespace=endpoint.namespace,
        component=endpoint.component,
        endpoint=endpoint.endpoint,
        instance_id=instance_id,
        url=f"http://127.0.0.1:{9000 + instance_id % 1000}",
        status_url=f"http://127.0.0.1:{8000 + instance_id % 1000}",
    )


@pytest.fixture
async def store() -> AsyncIterator[Store]:
    s = await open_store(f"memory://{uuid.uuid4().hex}")
    yield s
    await s.close()


async def register(
    disc: Discovery,
    endpoint: EndpointId,
    instance_id: int,
    card: ModelCard,
    suffix: str | None = None,
) -> ModelKey:
    key = ModelKey(endpoint, instance_id, suffix)
    await disc.register_instance(info(endpoint, instance_id), lease=0)
    await disc.register_model(key, card, lease=0)
    return key


class Watch(Collector[DiscoveryEvent]):
    """A discovery watch's events, and the models live after them."""

    def __init__(self, disc: Discovery, query: Query | None = None) -> None:
        super().__init__(disc.list_and_watch(query))

    def live(self) -> set[ModelKey]:
        live: set[ModelKey] = set()
        for e in self.events:
            if isinstance(e, Added):
                live.add(e.model.key)
            elif isinstance(e, Removed):
                live.discard(e.key)
        return live


async def test_list_and_watch_reports_existing_then_new_models(store: Store) -> None:
    disc = Discovery(store)
    first = await register(disc, EP, 0x10, make_card())
    watch = Watch(disc)
    try:
        await wait_for(lambda: watch.live() == {first})
        second = await register(disc, EP, 0x11, make_card())
        await wait_for(lambda: watch.live() == {first, second})
        added = [e for e in watch.events if isinstance(e, Added)]
        assert [e.model.url for e in added] == [info(EP, 0x10).url, info(EP, 0x11).url]
        await disc.unregister_model(first)
        await wait_for(lambda: watch.live() == {second})
    finally:
        await watch.close()


async def test_a_card_is_routable_only_while_its_instance_is_registered(store: Store) -> None:
    disc = Discovery(store)
    key = ModelKey(EP, 0x20)
    await disc.register_model(key, make_card(), lease=0)
    assert await disc.list() == []
    await disc.register_instance(info(EP, 0x20), lease=0)
    assert [m.key for m in await disc.list()] == [key]
    watch = Watch(disc)
    try:
        await wait_for(lambda: watch.live() == {key})
        await disc.unregister_instance(EP, 0x20)
        await wait_for(lambda: watch.live() == set())
    finally:
        await watch.close()


async def test_taint_changes_arrive_as_taints_updated(store: Store) -> None:
    disc = Discovery(store)
    key = await register(disc, EP, 0x30, make_card())
    watch = Watch(disc)
    try:
        await wait_for(lambda: watch.live() == {key})
        card = await disc.update_taints(key, ["draining"])
        assert card.taints == ("draining",)
        await wait_for(lambda: TaintsUpdated(key, ("draining",)) in watch.events)
        listed = await disc.list()
        assert listed[0].card.taints == ("draining",)
    finally:
        await watch.close()


async def test_card_changes_other_than_taints_are_ignored(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    disc = Discovery(store)
    key = await register(disc, EP, 0x40, make_card(context_length=4096))
    watch = Watch(disc)
    try:
        await wait_for(lambda: watch.live() == {key})
        caplog.set_level(logging.WARNING)
        changed = make_card(context_length=8192).with_taints(["draining"])
        await store.put(key.key, changed.to_json())
        # The taint part of the change is a legal update; the rest is ignored.
        marker = await register(disc, EP, 0x41, make_card())
        await wait_for(lambda: marker in watch.live())
        assert not any(isinstance(e, TaintsUpdated) for e in watch.events)
        assert "other than its taints" in caplog.text
        added = next(e for e in watch.events if isinstance(e, Added) and e.model.key == key)
        assert added.model.card.context_length == 4096
    finally:
        await watch.close()


async def test_malformed_values_are_skipped_and_never_hide_valid_ones(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    disc = Discovery(store)
    good = await register(disc, EP, 0x50, make_card())
    before = MALFORMED.labels("model")._value.get()
    await store.put(f"shoal/v1/models/{EP.path}/51", b"{not json")
    await store.put(f"shoal/v1/models/{EP.path}/zz-not-hex", make_card().to_json())
    await disc.register_instance(info(EP, 0x51), lease=0)
    listed = await disc.list()
    assert [m.key for m in listed] == [good]
    assert MALFORMED.labels("model")._value.get() >= before + 2
    assert "malformed" in caplog.text
    watch = Watch(disc)
    try:
        await wait_for(lambda: watch.live() == {good})
        # A bad value written over a valid card does not remove it.
        await store.put(good.key, b'{"display_name": 3}')
        marker = await register(disc, EP, 0x52, make_card())
        await wait_for(lambda: marker in watch.live())
        assert good in watch.live()
    finally:
        await watch.close()


async def test_a_card_of_thousands_of_metadata_files_is_skipped_as_malformed(
    store: Store,
) -> None:
    """A foreign writer's card of 6,300 metadata files (1 MB) was joined: a download of
    each for every frontend. Now it is skipped and counted as malformed, and the instance's
    valid card beside it is listed."""
    disc = Discovery(store)
    good = await register(disc, EP, 0x60, make_card())
    raw = msgspec.json.decode(make_card("big").to_json())
    sha = "sha256:" + "ab" * 32
    raw["metadata_files"] = {
        f"f{i}.json": {"url": f"http://w/f{i}.json", "checksum": sha, "size": 1}
        for i in range(6300)
    }
    before = MALFORMED.labels("model")._value.get()
    big = ModelKey(EP, 0x60, "big")
    await store.put(big.key, msgspec.json.encode(raw))
    assert [m.key for m in await disc.list()] == [good]
    assert MALFORMED.labels("model")._value.get() == before + 1
    assert big.key in disc.skipped


async def test_registering_a_different_model_on_a_served_instance_is_refused(store: Store) -> None:
    disc = Discovery(store)
    key = await register(disc, EP, 0x60, make_card("llama"))
    with pytest.raises(ModelConflictError, match="already serves model 'llama'"):
        await disc.register_model(key, make_card("mistral"), lease=0)
    await disc.register_model(key, make_card("llama"), lease=0)  # the same model again is fine
    assert [m.card.display_name for m in await disc.list()] == ["llama"]


async def test_adapters_are_separate_models_on_one_instance(store: Store) -> None:
    disc = Discovery(store)
    base = await register(disc, EP, 0x70, make_card("base"))
    adapter = ModelKey(EP, 0x70, "sql")
    await disc.register_model(
        adapter, make_card("base:sql", lora={"base_model": "base", "adapter": "sql"}), lease=0
    )
    assert [m.key for m in await disc.list()] == [base, adapter]
    await disc.unregister_model(adapter)
    assert [m.key for m in await disc.list()] == [base]


async def test_queries_scope_by_namespace_component_and_endpoint(store: Store) -> None:
    disc = Discovery(store)
    a = await register(disc, EndpointId("team", "backend", "generate"), 1, make_card())
    b = await register(disc, EndpointId("team2", "backend", "generate"), 2, make_card())
    c = await register(disc, EndpointId("team", "prefill", "generate"), 3, make_card())
    assert {m.key for m in await disc.list(Query("team"))} == {a, c}
    assert {m.key for m in await disc.list(Query("team", "backend"))} == {a}
    assert {m.key for m in await disc.list(Query("team", "backend", "generate"))} == {a}
    assert {m.key for m in await disc.list()} == {a, b, c}
    assert {i.instance_id for i in await disc.list_instances(Query("team2"))} == {2}


async def test_resync_after_outage_brings_the_watcher_up_to_date(store: Store) -> None:
    disc = Discovery(store)
    watcher_store = await open_store(store.url)
    try:
        keep = await register(disc, EP, 0x80, make_card())
        gone = await register(disc, EP, 0x81, make_card())
        watch = Watch(Discovery(watcher_store))
        await wait_for(lambda: watch.live() == {keep, gone})
        watcher_store.set_unreachable(True)
        await disc.unregister_model(gone)
        new = await register(disc, EP, 0x82, make_card())
        watcher_store.set_unreachable(False)
        await wait_for(lambda: watch.live() == {keep, new})
        await watch.close()
    finally:
        await watcher_store.close()


async def test_leased_registrations_vanish_with_their_lease(store: Store) -> None:
    disc = Discovery(store)
    lease = await store.grant(30)
    key = ModelKey(EP, lease.id)
    await disc.register_instance(info(EP, lease.id), lease=lease.id)
    await disc.register_model(key, make_card(), lease=lease.id)
    watch = Watch(disc)
    try:
        await wait_for(lambda: watch.live() == {key})
        await lease.revoke()
        await wait_for(lambda: watch.live() == set())
    finally:
        await watch.close()


async def test_listing_keeps_the_last_valid_card_over_bad_values_and_illegal_changes(
    store: Store,
) -> None:
    disc = Discovery(store)
    key = await register(disc, EP, 0x90, make_card(context_length=4096))
    assert [m.card.context_length for m in await disc.list()] == [4096]
    await store.put(key.key, b"{not json")
    assert [m.key for m in await disc.list()] == [key], "a bad value hid a valid card"
    await store.put(key.key, make_card(context_length=8192).to_json())
    assert [m.card.context_length for m in await disc.list()] == [4096]
    await store.put(key.key, make_card(context_length=4096).with_taints(["draining"]).to_json())
    assert [m.card.taints for m in await disc.list()] == [("draining",)]
    await disc.unregister_model(key)
    assert await disc.list() == []


async def test_every_reader_sees_a_cards_store_revision(store: Store) -> None:
    """Listings, watches and late watchers agree on the revision that last wrote a card."""
    disc = Discovery(store)
    key = await register(disc, EP, 0x50, make_card())
    watch = Watch(disc)
    try:
        await wait_for(lambda: watch.live() == {key})
        kv = await store.get(key.key)
        assert kv is not None
        [added] = [e for e in watch.events if isinstance(e, Added)]
        assert added.model.revision == kv.mod_revision > 0
        await disc.update_taints(key, ["draining"])
        kv = await store.get(key.key)
        assert kv is not None
        await wait_for(lambda: any(isinstance(e, TaintsUpdated) for e in watch.events))
        [updated] = [e for e in watch.events if isinstance(e, TaintsUpdated)]
        assert updated.revision == kv.mod_revision
        [listed] = await Discovery(store).list()
        assert listed.revision == kv.mod_revision
        late = Watch(Discovery(store))
        try:
            await wait_for(lambda: late.live() == {key})
            [late_added] = [e for e in late.events if isinstance(e, Added)]
            assert late_added.model.revision == kv.mod_revision
        finally:
            await late.close()
    finally:
        await watch.close()


@pytest.fixture
async def any_store(backend: Backend) -> AsyncIterator[Store]:
    """The same test on memory, SQLite and a real etcd."""
    s = await backend.open()
    yield s
    await s.close()


def _scoped() -> EndpointId:
    """An endpoint of this test's own, so tests sharing one etcd never see each other."""
    return EndpointId(f"ns{uuid.uuid4().hex[:10]}", "backend", "generate")


async def test_a_model_re_registered_at_the_same_key_is_listed_under_its_new_name(
    any_store: Store, backend: Backend
) -> None:
    """Detach then attach (the worker's `sync_models`) is a new registration, even for a
    listing or a resync that missed the delete: only an in-place change is ignored."""
    ep = _scoped()
    disc = Discovery(any_store)
    key = await register(disc, ep, 0xA0, make_card("llama"))
    assert [m.card.display_name for m in await disc.list(Query(ep.namespace))] == ["llama"]
    watch = Watch(disc, Query(ep.namespace))
    watcher_store = await open_store(any_store.url)
    resynced = Watch(Discovery(watcher_store), Query(ep.namespace))
    try:
        await wait_for(lambda: watch.live() == {key} and resynced.live() == {key})
        cut_off = backend.name != "etcd"  # etcd cannot cut one client off
        if cut_off:
            watcher_store.set_unreachable(True)
        await disc.unregister_model(key)
        await disc.register_model(key, make_card("mistral"), lease=0)
        if cut_off:
            watcher_store.set_unreachable(False)
        listed = await disc.list(Query(ep.namespace))
        assert [m.card.display_name for m in listed] == ["mistral"]

        def names(w: Watch) -> list[str]:
            return [e.model.card.display_name for e in w.events if isinstance(e, Added)]

        await wait_for(lambda: names(watch)[-1:] == ["mistral"] and watch.live() == {key})
        await wait_for(lambda: names(resynced)[-1:] == ["mistral"] and resynced.live() == {key})
    finally:
        await watch.close()
        await resynced.close()
        await watcher_store.close()


async def test_a_resync_over_a_re_registration_reports_the_new_card(store: Store) -> None:
    """The watcher misses both the delete and the create: the Resync alone must tell."""
    disc = Discovery(store)
    watcher_store = await open_store(store.url)
    try:
        key = await register(disc, EP, 0xA1, make_card("llama"))
        watch = Watch(Discovery(watcher_store))
        await wait_for(lambda: watch.live() == {key})
        watcher_store.set_unreachable(True)
        await disc.unregister_model(key)
        await disc.register_model(key, make_card("mistral"), lease=0)
        watcher_store.set_unreachable(False)
        await wait_for(
            lambda: [e.model.card.display_name for e in watch.of(Added)] == ["llama", "mistral"]
        )
        assert watch.live() == {key}
        await watch.close()
    finally:
        await watcher_store.close()


async def test_list_and_watch_ends_when_the_store_is_closed(backend: Backend) -> None:
    store = await backend.open()
    ep = _scoped()
    disc = Discovery(store)
    key = await register(disc, ep, 0xB0, make_card())
    watch = Watch(disc, Query(ep.namespace))
    try:
        await wait_for(lambda: watch.live() == {key})
        await store.close()
        await wait_for(lambda: watch.task.done(), timeout=10, message="the stream ended")
    finally:
        await watch.close()
        await store.close()


async def test_a_non_canonical_instance_key_never_hides_the_real_instance(store: Store) -> None:
    disc = Discovery(store)
    key = await register(disc, EP, 0x2A, make_card())
    watch = Watch(disc)
    try:
        await wait_for(lambda: watch.live() == {key})
        before = MALFORMED.labels("instance")._value.get()
        alias = f"shoal/v1/instances/{EP.path}/002A"
        await store.put(alias, msgspec.json.encode(info(EP, 0x2A)))
        await store.delete(alias)
        await store.put(f"shoal/v1/models/{EP.path}/02a", make_card("alias").to_json())
        marker = await register(disc, EP, 0x2B, make_card())
        await wait_for(lambda: marker in watch.live())
        assert watch.live() == {key, marker}
        assert [m.key for m in await disc.list()] == [key, marker]
        assert MALFORMED.labels("instance")._value.get() >= before + 1
    finally:
        await watch.close()


async def test_a_slow_consumer_of_list_and_watch_holds_bounded_memory(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events a consumer does not read stay within the store's `MAX_QUEUED` guard (then it
    gets a Resync): `list_and_watch` keeps no queue of its own."""
    monkeypatch.setattr(memory, "MAX_QUEUED", 20, raising=False)
    disc = Discovery(store)
    stream = disc.list_and_watch()
    first = await register(disc, EP, 0xC0, make_card())
    assert isinstance(await anext(stream), Added)
    # Not read from now on: 200 registrations arrive.
    reader = asyncio.ensure_future(anext(stream))
    await wait_for(lambda: len(store._d.watchers) == 1)  # type: ignore[attr-defined]
    for i in range(200):
        await register(disc, EP, 0xD00 + i, make_card())
        await asyncio.sleep(0)
    assert isinstance(await reader, Added)
    held = sum(w[1].qsize() for w in store._d.watchers)  # type: ignore[attr-defined]
    assert held <= 20 + 1, held
    seen = {first, reader.result().model.key}
    while len(seen) < 201:
        event = await asyncio.wait_for(anext(stream), 5)
        if isinstance(event, Added):
            seen.add(event.model.key)
    await stream.aclose()


async def test_a_cancel_during_list_and_watch_cleanup_is_not_swallowed(store: Store) -> None:
    stopping, release = asyncio.Event(), asyncio.Event()

    class SlowToStop(memory.MemoryStore):
        async def watch_prefixes(
            self, prefixes: Sequence[str], start_revision: int
        ) -> AsyncGenerator[Event, None]:
            try:
                async for event in super().watch_prefixes(prefixes, start_revision):
                    yield event
            finally:
                stopping.set()
                await release.wait()  # a watch that takes a while to wind down

    slow = SlowToStop(store.url)
    disc = Discovery(slow)
    await register(disc, EP, 0xE0, make_card())
    stream = disc.list_and_watch()
    later = ModelKey(EP, 0xE1)

    async def consume() -> str:
        async for event in stream:
            if isinstance(event, Added) and event.model.key == later:
                break
        await stream.aclose()  # its cleanup waits for the watches to wind down
        return "went on after being cancelled"

    consumer = asyncio.create_task(consume())
    await wait_for(lambda: len(store._d.watchers) == 1)  # type: ignore[attr-defined]
    await register(disc, EP, 0xE1, make_card())
    await wait_for(lambda: stopping.is_set())
    consumer.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await slow.close()


async def test_an_in_place_change_stays_ignored_after_a_resync(store: Store) -> None:
    """The Resync carries the key's create revision: a card first seen in a live event keeps
    it, so an illegal change is not mistaken for a new registration later."""
    disc = Discovery(store)
    watcher_store = await open_store(store.url)
    try:
        watch = Watch(Discovery(watcher_store))
        await wait_for(lambda: len(store._d.watchers) == 1)  # type: ignore[attr-defined]
        key = await register(disc, EP, 0xF0, make_card(context_length=4096))
        await wait_for(lambda: watch.live() == {key})
        await store.put(key.key, make_card(context_length=8192).to_json())
        watcher_store.set_unreachable(True)
        watcher_store.set_unreachable(False)
        marker = await register(disc, EP, 0xF1, make_card())
        await wait_for(lambda: marker in watch.live())
        assert [e.model.card.context_length for e in watch.of(Added) if e.model.key == key] == [
            4096
        ]
        await watch.close()
    finally:
        await watcher_store.close()


async def test_a_skipped_key_is_no_longer_listed_as_skipped_once_deleted(store: Store) -> None:
    """`skipped` names only keys in the store: a listing forgets those that are gone, also
    one whose card was held while a change to it was being ignored."""
    disc = Discovery(store)
    key = await register(disc, EP, 0x110, make_card(context_length=4096))
    bad = f"shoal/v1/models/{EP.path}/111"
    await store.put(bad, b"{not json")
    await disc.list()
    await store.put(key.key, make_card(context_length=8192).to_json())
    [listed] = await disc.list()
    assert listed.card.context_length == 4096
    assert set(disc.skipped) == {key.key, bad}
    await store.delete(key.key)
    await store.delete(bad)
    assert await disc.list() == []
    assert disc.skipped == {}


async def test_a_key_created_again_with_a_malformed_value_removes_the_old_card(
    store: Store,
) -> None:
    """A new `create_revision` is a new registration even when its value is malformed: a
    listing and a `Resync` that missed the delete agree with a watcher that saw it."""
    disc = Discovery(store)
    watcher_store = await open_store(store.url)
    try:
        key = await register(disc, EP, 0x120, make_card())
        marker = await register(disc, EP, 0x121, make_card())
        assert [m.key for m in await disc.list()] == [key, marker]
        live, resynced = Watch(disc), Watch(Discovery(watcher_store))
        await wait_for(lambda: live.live() == resynced.live() == {key, marker})
        watcher_store.set_unreachable(True)
        await disc.unregister_model(key)
        await store.put(key.key, b"{not json")
        watcher_store.set_unreachable(False)
        assert [m.key for m in await disc.list()] == [marker]
        await wait_for(lambda: live.live() == resynced.live() == {marker})
        assert disc.skipped[key.key]
        await live.close()
        await resynced.close()
    finally:
        await watcher_store.close()


async def test_a_listing_parses_only_what_changed_since_the_last_one(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reconciliation lists thousands of keys every pass: a value read again at the revisions
    it was read at is not parsed again, and a model that did not move is the same object."""
    disc = Discovery(store)
    keys = [await register(disc, EP, 0x130 + i, make_card()) for i in range(3)]
    first = await disc.list()
    assert [m.key for m in first] == keys
    parsed: list[str] = []
    from_json = ModelCard.from_json

    def counting_from_json(data: bytes | str) -> ModelCard:
        parsed.append("card")
        return from_json(data)

    class CountingDecoder:
        def decode(self, data: bytes) -> InstanceInfo:
            parsed.append("instance")
            return msgspec.json.decode(data, type=InstanceInfo)

    monkeypatch.setattr(ModelCard, "from_json", counting_from_json)
    monkeypatch.setattr(values, "_instance_decoder", CountingDecoder())
    again = await disc.list()
    assert parsed == []
    assert all(a is b for a, b in zip(again, first, strict=True))
    await disc.update_taints(keys[1], ["draining"])
    parsed.clear()  # the update read the card it changes
    third = await disc.list()
    assert parsed == ["card"]
    assert third[0] is first[0] and third[2] is first[2]
    assert third[1].card.taints == ("draining",)


async def test_an_instance_record_with_fields_this_version_does_not_know_is_read(
    store: Store,
) -> None:
    """A newer worker's instance record (an extra field) stays visible to an older frontend,
    and a record without the optional fields is written without them."""
    disc = Discovery(store)
    key = await register(disc, EP, 0x77, make_card())
    raw = await store.get(key.instance_key)
    assert raw is not None and b"kv_events" not in raw.value
    newer = raw.value[:-1] + b',"from_the_future":{"x":1}}'
    await store.put(key.instance_key, newer)
    assert [m.key for m in await Discovery(store).list()] == [key]


async def test_a_resync_reports_a_moved_registration_before_the_old_one_leaves(
    store: Store,
) -> None:
    """A worker re-registered under a new instance id while the watcher was cut off: the
    `Resync` brings the new registration and the end of the old one together. A consumer
    applying the events one by one never goes without the model in between."""
    disc = Discovery(store)
    watcher_store = await open_store(store.url)
    try:
        old = await register(disc, EP, 0x1, make_card())
        watch = Watch(Discovery(watcher_store))
        await wait_for(lambda: watch.live() == {old})
        watcher_store.set_unreachable(True)
        new = await register(disc, EP, 0x2, make_card())  # after `old` in key order
        await disc.unregister_model(old)
        await disc.unregister_instance(EP, 0x1)
        watcher_store.set_unreachable(False)
        await wait_for(lambda: watch.live() == {new})
        moved = [e for e in watch.events if not (isinstance(e, Added) and e.model.key == old)]
        assert [type(e) for e in moved] == [Added, Removed], moved
        assert isinstance(moved[0], Added) and moved[0].model.key == new
        assert moved[1] == Removed(old)
        await watch.close()
    finally:
        await watcher_store.close()


async def test_many_streams_started_at_once_list_with_bounded_concurrency() -> None:
    """A frontend that follows thousands of namespaces starts a stream for each at once;
    their first listings go to the store a bounded number at a time, not all together."""
    inner = await open_store(f"memory://{uuid.uuid4().hex}")
    in_flight = [0, 0]  # now, most

    class SlowStore(memory.MemoryStore):
        async def get_prefixes(
            self, prefixes: Sequence[str], *, on_answer: Callable[[], None] | None = None
        ) -> Snapshot:
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
            try:
                await asyncio.sleep(0.002)  # a slow store: listings overlap
                return await inner.get_prefixes(prefixes, on_answer=on_answer)
            finally:
                in_flight[0] -= 1

    discovery = Discovery(SlowStore())
    listed: list[str] = []

    async def follow(namespace: str) -> None:
        done = asyncio.Event()
        stream = discovery.list_and_watch(Query(namespace=namespace), on_listed=done.set)
        listing = asyncio.ensure_future(anext(stream))  # (nothing listed: no event comes)
        await asyncio.wait_for(done.wait(), 30)
        listed.append(namespace)
        listing.cancel()
        await asyncio.gather(listing, return_exceptions=True)
        await stream.aclose()

    await asyncio.gather(*(follow(f"ns-{i}") for i in range(300)))
    assert len(listed) == 300
    assert in_flight[1] <= service.MAX_LISTINGS, in_flight[1]
    await inner.close()


async def test_the_first_listing_of_a_stream_of_10000_models_never_holds_the_event_loop() -> None:
    """A frontend restarting a discovery stream (after a store error) lists its whole scope
    again while it serves: the snapshot is joined and reported in batches, yielding to the
    event loop between them (in one go, 10,000 models held it ~0.13 s). Counted, not timed:
    values parsed, keys reported and events handed over, `LIST_BATCH` at most a turn."""
    from tests.membership.support import add_endpoint

    store = await open_store(f"memory://{uuid.uuid4().hex}")
    try:
        writer = Discovery(store)
        for i in range(10000):
            await add_endpoint(writer, f"ns-{i % 50}", i + 1)
        parsed = LoopTurns().wrap(join.CardsAndInstances, "_put")
        reported = LoopTurns().wrap(join.CardsAndInstances, "_rejoin")
        handed = LoopTurns()

        async def follow() -> None:
            async for event in Discovery(store).list_and_watch():
                assert isinstance(event, Added)
                handed.note()

        task = asyncio.create_task(follow())
        try:
            await wait_for(lambda: handed.on_loop == 10000, message="every model listed")
        finally:
            for turns in (parsed, reported, handed):
                await turns.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert parsed.on_loop == 2 * 10000 and reported.on_loop == 10000  # (instance, card)
        for turns in (parsed, reported, handed):
            assert turns.most_per_turn <= join.LIST_BATCH, turns.most_per_turn
    finally:
        await store.close()


async def test_a_burst_of_store_changes_reaches_the_consumer_a_batch_per_loop_turn(
    store: Store,
) -> None:
    """A store hands a watch's backlog over without a turn of the event loop between its
    events (etcd's catch-up after a cut, one large transaction, a memory or SQLite queue),
    and `list_and_watch` yielded to the loop only within one store event's report: 4,000
    cards re-tainted during a cut held a frontend's loop 340-608 ms. Now store events and
    the events they report are counted across store events, and every `LIST_BATCH` of
    them is a turn of the loop."""
    disc = Discovery(store)
    keys = [await register(disc, EP, i, make_card()) for i in range(1, 301)]
    turns = LoopTurns()
    taints: list[TaintsUpdated] = []

    async def follow() -> None:
        async for event in disc.list_and_watch():
            turns.note()
            if isinstance(event, TaintsUpdated):
                taints.append(event)

    task = asyncio.create_task(follow())
    try:
        await wait_for(lambda: sum(turns.per_turn.values()) == 300, message="listed")
        turns.per_turn.clear()
        for key in keys:  # (no turn of the loop between them: the watch's queue fills)
            await disc.update_taints(key, ["draining"])
        await wait_for(lambda: len(taints) == 300, message="every change reported")
        assert [e.key for e in taints] == keys
        assert 0 < turns.most_per_turn <= join.LIST_BATCH
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await turns.stop()


class CountingListings:
    """Counts the listings a store serves (with or without values)."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in ("get_prefixes", "get_prefixes_changed"):
            monkeypatch.setattr(store, name, self._counted(getattr(store, name)))

    def _counted(self, method: Callable[..., object]) -> Callable[..., object]:
        def counted(*args: object, **kwargs: object) -> object:
            self.count += 1
            return method(*args, **kwargs)

        return counted


async def test_a_stream_after_a_listing_reports_only_what_changed_since_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frontend lists its scope, applies it, then watches: the stream starts from that
    listing (no second listing of the fleet, no `Added` for what it listed) and reports
    every change written after it, none lost in between."""
    store = await backend.open()
    try:
        ep = _scoped()
        query = Query(ep.namespace)
        disc = Discovery(store)
        keys = [await register(disc, ep, 0x300 + i, make_card()) for i in range(3)]
        assert [m.key for m in await disc.list(query)] == keys
        # Written after the listing, before the stream starts:
        await disc.unregister_model(keys[0])
        await disc.update_taints(keys[1], ["draining"])
        new = await register(disc, ep, 0x310, make_card())
        listings = CountingListings(store, monkeypatch)
        watch = Collector(disc.list_and_watch(query, after_listing=True))
        try:
            await wait_for(
                lambda: (
                    Removed(keys[0]) in watch.events
                    and any(isinstance(e, TaintsUpdated) and e.key == keys[1] for e in watch.events)
                    and any(isinstance(e, Added) and e.model.key == new for e in watch.events)
                ),
                message="the changes since the listing",
            )
            added = [e.model.key for e in watch.of(Added)]
            assert added == [new]  # nothing listed before is reported again
            if backend.name != "etcd":
                # (etcd's watch of two prefixes from a past revision reads them once more
                # when the store moved since: its watchers would catch up out of order.)
                assert listings.count == 0
            await disc.unregister_model(keys[2])
            await wait_for(lambda: Removed(keys[2]) in watch.events, message="a later change")
        finally:
            await watch.close()
    finally:
        await store.close()


async def test_a_stream_after_a_listing_lists_its_query_when_no_listing_is_held(
    store: Store,
) -> None:
    disc = Discovery(store)
    ep = _scoped()
    key = await register(disc, ep, 0x320, make_card())
    watch = Collector(disc.list_and_watch(Query(ep.namespace), after_listing=True))
    try:
        await wait_for(lambda: len(watch.of(Added)) == 1, message="the snapshot's Added")
        [added] = watch.of(Added)
        assert isinstance(added, Added) and added.model.key == key
    finally:
        await watch.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: EndpointId("ns\n", "backend", "generate"),
        lambda: EndpointId("ns", "backend", "generate\n"),
        lambda: ModelKey(EP, 1, keys.check_suffix("lora\n")),
        lambda: keys.parse_model_key(f"shoal/v1/models/{EP.path}/2a/lora\n"),
    ],
    ids=["namespace", "endpoint", "suffix", "key"],
)
def test_a_name_with_a_trailing_newline_is_refused(make: Callable[[], object]) -> None:
    """`re.match` with `^...$` let "ns\\n" through (`$` matches before a final newline)."""
    with pytest.raises(ValueError, match=r"invalid|malformed"):
        make()


def test_an_invalid_name_is_quoted_at_most_64_characters_and_its_length() -> None:
    """A 1 MB name was quoted whole in the error (then in status, health and logs)."""
    with pytest.raises(ValueError) as caught:
        keys.check_name("namespace", "x " * 500_000)
    assert len(str(caught.value)) < 200 and "(1,000,000 characters)" in str(caught.value)
