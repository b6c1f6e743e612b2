"""`Store.put_many`, proved on every backend: many keys put in few transactions, each key
still a change of its own to a watcher, and still under its lease."""

from __future__ import annotations

import pytest

from shoal.store import (
    MAX_VALUE_BYTES,
    Delete,
    InvalidKeyError,
    LeaseNotFoundError,
    Put,
    Resync,
    Store,
    ValueTooLargeError,
    sqlite_log,
)
from shoal.store import base as base_module
from shoal.store import sqlite as sqlite_module
from tests.helpers import LoopTurns, wait_for
from tests.store.conftest import Backend
from tests.store.support import Recorder

MANY = 600
"""More keys than one etcd transaction takes (128) and than one SQLite slice writes."""


def _items(prefix: str, count: int, tag: str = "v") -> list[tuple[str, bytes]]:
    return [(f"{prefix}k{i:04d}", f"{tag}{i}".encode()) for i in range(count)]


async def test_put_many_writes_every_value_readable(store: Store, prefix: str) -> None:
    await store.put(prefix + "k0001", b"old")
    items = _items(prefix, MANY)
    revision = await store.put_many(items)
    snap = await store.get_prefix(prefix)
    assert [(kv.key, kv.value) for kv in snap.items] == items
    assert snap.revision >= revision
    assert max(kv.mod_revision for kv in snap.items) == revision
    kv = await store.get(prefix + "k0001")
    assert kv is not None and kv.value == b"v1"


async def test_a_watch_after_a_listing_gets_one_put_per_key_of_a_put_many(
    store: Store, prefix: str
) -> None:
    """List-then-watch across a put_many: every key comes as its own `Put`, once, in
    revision order, no `Resync` (the revision a backend gives several keys of one
    transaction is theirs alike: a consumer must not take a second key at a revision for a
    change it has)."""
    await store.put(prefix + "before", b"b")
    snap = await store.get_prefix(prefix)
    mirror = Recorder(
        store.watch(prefix, snap.revision + 1), {kv.key: kv.value for kv in snap.items}
    )
    try:
        items = _items(prefix, MANY)
        revision = await store.put_many(items)
        last = await store.put(prefix + "after", b"a")
        expected = {prefix + "before": b"b", **dict(items), prefix + "after": b"a"}
        await wait_for(lambda: mirror.ordered_state() == expected, timeout=30)
        assert not any(isinstance(e, Resync) for e in mirror.events)
        puts = [e for e in mirror.events if isinstance(e, Put)]
        assert [e.key for e in puts] == [key for key, _ in items] + [prefix + "after"]
        assert all(snap.revision < e.revision <= revision for e in puts[:-1])
        assert puts[-1].revision == last > revision
    finally:
        await mirror.close()


async def test_a_put_many_splits_into_transactions_etcd_takes(store: Store, prefix: str) -> None:
    """etcd refuses a transaction of more than 128 operations by default: no revision of a
    put_many holds more keys than that, on any backend."""
    snap = await store.get_prefix(prefix)
    await store.put_many(_items(prefix, MANY))
    keys_at: dict[int, int] = {}
    for kv in (await store.get_prefix(prefix)).items:
        assert kv.mod_revision > snap.revision
        keys_at[kv.mod_revision] = keys_at.get(kv.mod_revision, 0) + 1
    assert max(keys_at.values()) <= 128


async def test_a_put_many_larger_than_one_etcd_request_is_written_whole(
    store: Store, prefix: str
) -> None:
    """etcd refuses a request over 1.5 MiB by default: 2 MiB of values in one call are
    split into transactions under it."""
    items = [(f"{prefix}big{i}", bytes([65 + i]) * (512 * 1024)) for i in range(4)]
    await store.put_many(items)
    snap = await store.get_prefix(prefix)
    assert [(kv.key, kv.value) for kv in snap.items] == items


async def test_keys_of_a_put_many_vanish_with_their_lease(store: Store, prefix: str) -> None:
    lease = await store.grant(1.0, keepalive=False)
    items = _items(prefix, MANY)
    await store.put_many(items, lease=lease.id)
    snap = await store.get_prefix(prefix)
    assert {kv.key for kv in snap.items} == {key for key, _ in items}
    assert {kv.lease for kv in snap.items} == {lease.id}
    mirror = Recorder(
        store.watch(prefix, snap.revision + 1), {kv.key: kv.value for kv in snap.items}
    )
    try:
        await wait_for(lambda: mirror.state == {}, timeout=10)
        assert (await store.get_prefix(prefix)).items == []
        deleted = [e.key for e in mirror.events if isinstance(e, Delete)]
        if not any(isinstance(e, Resync) for e in mirror.events):
            assert sorted(deleted) == [key for key, _ in items]
    finally:
        await mirror.close()


async def test_a_put_many_under_a_lease_that_is_gone_raises_and_writes_nothing(
    store: Store, prefix: str
) -> None:
    lease = await store.grant(30, keepalive=False)
    await lease.revoke()
    with pytest.raises(LeaseNotFoundError):
        await store.put_many(_items(prefix, 3), lease=lease.id)
    assert (await store.get_prefix(prefix)).items == []


@pytest.mark.parametrize(
    "bad",
    [
        ("", b"x"),
        ("/leading", b"x"),
        ("big", b"x" * (MAX_VALUE_BYTES + 1)),
    ],
)
async def test_a_put_many_refuses_an_invalid_item_before_it_writes_any(
    store: Store, prefix: str, bad: tuple[str, bytes]
) -> None:
    key, value = bad
    items = [*_items(prefix, 3), (prefix + key if key == "big" else key, value)]
    with pytest.raises((InvalidKeyError, ValueTooLargeError)):
        await store.put_many(items)
    assert (await store.get_prefix(prefix)).items == []


async def test_a_put_many_checks_its_items_a_slice_per_turn_of_the_loop(
    store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was wrong: `put_many` checked every item (key, value) in one turn of the event
    loop before its first write: 20,000 items held the loop 25-43 ms on every backend. What
    holds now: it checks `CHECK_SLICE` items per turn, every item still before the first
    write (an invalid one still refuses the call with nothing written)."""
    monkeypatch.setattr(base_module, "CHECK_SLICE", 64, raising=False)
    checks = LoopTurns().wrap(base_module, "check_key")
    try:
        await store.put_many(_items(prefix, MANY))
    finally:
        await checks.stop()
    assert checks.on_loop == MANY
    assert checks.most_per_turn <= 64
    assert len((await store.get_prefix(prefix)).items) == MANY


async def test_a_key_given_twice_to_a_put_many_ends_with_its_last_value(
    store: Store, prefix: str
) -> None:
    await store.put_many([(prefix + "k", b"1"), (prefix + "j", b"2"), (prefix + "k", b"3")])
    snap = await store.get_prefix(prefix)
    assert [(kv.key, kv.value) for kv in snap.items] == [(prefix + "j", b"2"), (prefix + "k", b"3")]


async def test_a_put_many_of_nothing_writes_nothing(store: Store, prefix: str) -> None:
    snap = await store.get_prefix(prefix)
    await store.put_many([])
    assert (await store.get_prefix(prefix)).items == snap.items == []


async def test_sqlite_puts_many_keys_in_few_transactions_off_the_loop(
    backend: Backend, store: Store, prefix: str
) -> None:
    """What was wrong: a worker re-putting 20,000 cards after a lost lease wrote each in a
    transaction of its own (8-27 s). What holds now: SQLite writes `PUT_MANY_KEYS` keys per
    transaction, in the store's thread."""
    if backend.name != "sqlite":
        pytest.skip("SQLite's transactions")
    turns = LoopTurns().wrap(sqlite_module, "_put_many")
    try:
        await store.put_many(_items(prefix, MANY))
    finally:
        await turns.stop()
    slices = -(-MANY // sqlite_log.PUT_MANY_KEYS)
    assert turns.off_loop == slices and turns.on_loop == 0
    assert len((await store.get_prefix(prefix)).items) == MANY


async def test_sqlite_keeps_a_put_many_longer_than_its_change_log_count_so_a_watch_gets_every_key(
    backend: Backend, store: Store, prefix: str
) -> None:
    """A watch reads SQLite's change log every `POLL_INTERVAL`: a put_many of more keys than
    the `RETAIN_CHANGES` revisions it keeps however old, written at full speed, stays in the
    log (it keeps every change of the last `RETAIN_SECONDS`), so each key is a `Put` to a
    watch of another client, not a `Resync` of its whole prefix."""
    if backend.name != "sqlite":
        pytest.skip("SQLite's change log")
    many = 3 * sqlite_log.RETAIN_CHANGES
    watcher = await backend.open()
    snap = await watcher.get_prefix(prefix)
    mirror = Recorder(watcher.watch(prefix, snap.revision + 1))
    try:
        items = _items(prefix, many)
        await store.put_many(items)
        await wait_for(lambda: len(mirror.state) == many, timeout=30)
        assert not any(isinstance(e, Resync) for e in mirror.events)
        assert [e.key for e in mirror.events if isinstance(e, Put)] == [k for k, _ in items]
    finally:
        await mirror.close()
        await watcher.close()
