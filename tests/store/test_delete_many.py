"""`Store.delete_many`, proved on every backend: many keys deleted in few transactions, each
still a `Delete` of its own to a watcher (a worker withdrawing the thousands of adapters its
upstream no longer lists did it one store call, one SQLite transaction, each)."""

from __future__ import annotations

import pytest

from shoal.store import Delete, InvalidKeyError, Put, Resync, Store, sqlite_log
from shoal.store import sqlite as sqlite_module
from tests.helpers import LoopTurns, wait_for
from tests.store.conftest import Backend
from tests.store.support import Recorder

MANY = 600
"""More keys than one etcd transaction takes (128) and than one SQLite slice writes."""


async def test_delete_many_deletes_each_key_once_and_a_watch_gets_a_delete_each(
    store: Store, prefix: str
) -> None:
    items = [(f"{prefix}k{i:04d}", b"v") for i in range(MANY)]
    await store.put_many([*items, (prefix + "kept", b"k")])
    snap = await store.get_prefix(prefix)
    mirror = Recorder(
        store.watch(prefix, snap.revision + 1), {kv.key: kv.value for kv in snap.items}
    )
    try:
        gone = [key for key, _ in items] + [prefix + "never-there"]
        assert await store.delete_many(gone) == MANY
        last = await store.put(prefix + "after", b"a")
        await wait_for(lambda: any(e.revision >= last for e in mirror.events), timeout=15)
    finally:
        await mirror.close()
    deletes = [e for e in mirror.events if isinstance(e, Delete)]
    assert sorted(e.key for e in deletes) == sorted(key for key, _ in items)
    assert not any(isinstance(e, Resync) for e in mirror.events)
    assert [e.key for e in mirror.events if isinstance(e, Put)] == [prefix + "after"]
    assert mirror.ordered_state() == {prefix + "kept": b"k", prefix + "after": b"a"}
    assert [kv.key for kv in (await store.get_prefix(prefix)).items] == [
        prefix + "after",
        prefix + "kept",
    ]


async def test_delete_many_refuses_an_invalid_key_before_deleting_any(
    store: Store, prefix: str
) -> None:
    await store.put(prefix + "a", b"1")
    with pytest.raises(InvalidKeyError):
        await store.delete_many([prefix + "a", "bad key with spaces"])
    assert await store.get(prefix + "a") is not None
    assert await store.delete_many([]) == 0


async def test_delete_many_takes_few_transactions(
    backend: Backend, store: Store, prefix: str
) -> None:
    """SQLite: `sqlite_log.PUT_MANY_KEYS` deletes per write transaction, not one each."""
    if backend.name != "sqlite":
        pytest.skip("counts SQLite's transactions")
    keys = [f"{prefix}k{i:04d}" for i in range(MANY)]
    await store.put_many([(key, b"v") for key in keys])
    transactions = LoopTurns().wrap(sqlite_module, "_delete_many")
    try:
        assert await store.delete_many(keys) == MANY
    finally:
        await transactions.stop()
    assert transactions.off_loop <= -(-MANY // sqlite_log.PUT_MANY_KEYS) + 1


async def test_delete_many_of_a_key_given_twice_deletes_it_once(store: Store, prefix: str) -> None:
    keys = [f"{prefix}k{i:03d}" for i in range(300)]
    await store.put_many([(key, b"v") for key in keys])
    snap = await store.get_prefix(prefix)
    mirror = Recorder(store.watch(prefix, snap.revision + 1), {key: b"v" for key in keys})
    try:
        assert await store.delete_many([*keys, *reversed(keys), keys[0]]) == len(keys)
        last = await store.put(prefix + "after", b"a")
        await wait_for(lambda: any(e.revision >= last for e in mirror.events), timeout=15)
    finally:
        await mirror.close()
    assert sorted(e.key for e in mirror.events if isinstance(e, Delete)) == keys
    assert mirror.ordered_state() == {prefix + "after": b"a"}


async def test_delete_many_of_a_key_given_many_times_takes_one_transaction(
    backend: Backend, store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was wrong (etcd): a key given twice started the next transaction (etcd refuses a
    key twice in one), so a key given 2,000 times took 2,000 round trips one after the other
    (3.2 s), a delete that can delete nothing each. Each key is now deleted once."""
    if backend.name == "memory":
        pytest.skip("counts the transactions of a backend with transactions")
    calls: list[int] = []
    if backend.name == "etcd":
        from shoal.store.etcd import EtcdStore

        txn = EtcdStore._txn

        async def counted(self: EtcdStore, what: str, requests: list[object]) -> object:
            calls.append(len(requests))
            return await txn(self, what, requests)

        monkeypatch.setattr(EtcdStore, "_txn", counted)
    else:
        write = sqlite_module._delete_many

        def counted_write(conn: object, now: float, keys: list[str]) -> object:
            calls.append(len(keys))
            return write(conn, now, keys)  # type: ignore[arg-type]

        monkeypatch.setattr(sqlite_module, "_delete_many", counted_write)
    await store.put_many([(prefix + "a", b"1"), (prefix + "b", b"2")])
    calls.clear()  # (etcd's put_many is a transaction too)
    assert await store.delete_many([prefix + "a", prefix + "b"] * 1000) == 2
    assert len(calls) == 1 and calls[0] == 2
    assert (await store.get_prefix(prefix)).items == []
