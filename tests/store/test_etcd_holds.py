"""The etcd store never holds the event loop over a whole batch of etcd's: what etcd sends
in one message (a watch's catch-up from history, a replayed listing of what changed) is
converted a slice at a time (`CONVERT_SLICE`) between turns of the loop."""

from __future__ import annotations

import asyncio
import os

import aetcd.rpc
import pytest

from shoal.store import Put, Resync, Store, etcd_txn, etcd_watch, open_store
from shoal.store.etcd import EtcdStore
from tests.etcd_server import EtcdServer
from tests.helpers import LoopTurns, wait_for

pytestmark = pytest.mark.etcd


@pytest.fixture
def store(etcd_store: Store) -> Store:
    return etcd_store  # (`prefix`: tests/store/conftest.py's)


KEYS = 5000


async def written_since(store: Store, prefix: str) -> int:
    """The revision before `KEYS` small keys are put under `prefix` (in 40 transactions)."""
    await store.put(f"{prefix}seed", b"s")
    since = (await store.get_prefix(prefix)).revision
    await store.put_many([(f"{prefix}k/{i:05d}", os.urandom(40)) for i in range(KEYS)])
    return since


async def test_a_listing_of_what_changed_replayed_from_history_converts_a_slice_per_turn(
    store: Store, prefix: str
) -> None:
    """A reconcile pass after a worker put 5,000 cards at once: the 5,000 replayed changes
    were converted in one piece (20,000: 46 ms of the loop on the shared machine)."""
    assert isinstance(store, EtcdStore)
    since = await written_since(store, prefix)
    turns = LoopTurns().wrap(store, "_kv")
    try:
        listing = await store.get_prefixes_changed((prefix,), since)
    finally:
        await turns.stop()
    assert listing.removed == []  # (a delta: replayed from etcd's history)
    assert [kv.key for kv in listing.items] == [f"{prefix}k/{i:05d}" for i in range(KEYS)]
    assert turns.most_per_turn <= etcd_txn.CONVERT_SLICE


async def test_a_watch_catching_up_from_history_converts_a_slice_per_turn(
    store: Store, prefix: str
) -> None:
    """A watch started behind 5,000 changes gets them from etcd in one message (a batch of
    revisions, fragmented only past 1.5 MiB), which was converted in one piece (20,000:
    50-108 ms of the loop)."""
    assert isinstance(store, EtcdStore)
    since = await written_since(store, prefix)
    turns = LoopTurns().wrap(store, "_event")
    keys: list[str] = []
    try:
        async for event in store.watch(prefix, since + 1):
            keys.append(event.key)
            if len(keys) == KEYS:
                break
    finally:
        await turns.stop()
    assert keys == [f"{prefix}k/{i:05d}" for i in range(KEYS)]
    assert turns.most_per_turn <= etcd_txn.CONVERT_SLICE


async def test_watches_opened_at_once_open_a_few_per_loop_turn(store: Store, prefix: str) -> None:
    """A frontend following 10,000 namespaces opens a watch of two prefixes for each at
    once, and all again when etcd comes back: every watch opened its stream and caught up
    in the same turn of the event loop (3,000 watches: a 1.1 s hold). At most
    `OPENING_WATCHES` open at a time; every one of them then follows its prefixes."""
    assert isinstance(store, EtcdStore)
    count = 400
    start = (await store.get_prefix(prefix)).revision
    await store.put(f"{prefix}before", b"x")  # (each watch catches up: a read at its start)
    seen: set[int] = set()

    async def follow(i: int) -> None:
        a, b = f"{prefix}{i}/a/", f"{prefix}{i}/b/"
        async for event in store.watch_prefixes((a, b), start + 1):
            if isinstance(event, Put) or (isinstance(event, Resync) and event.items):
                seen.add(i)  # (a watch still catching up reads the key in its `Resync`)

    turns = LoopTurns().wrap(aetcd.rpc, "WatchStub")
    tasks = [asyncio.create_task(follow(i)) for i in range(count)]
    try:
        await wait_for(lambda: turns.on_loop >= count, 30, message="every watch opened")
        await store.put_many([(f"{prefix}{i}/b/k", b"v") for i in range(count)])
        await wait_for(lambda: len(seen) == count, 30, message="every watch follows")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await turns.stop()
    assert turns.most_per_turn <= etcd_watch.OPENING_WATCHES


async def test_a_watch_logs_its_outage_once_not_at_every_attempt(
    own_etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    """While etcd is down every watch fails again at each attempt to get it back: a frontend
    of 3,000 namespaces logged 11,000 lines at INFO over one restart (the formatting alone a
    large part of a 200 ms hold). One line at INFO per watch and outage; the retries at
    DEBUG, and the watch's listeners still hear of each."""
    store = await open_store(own_etcd.url)
    failures: list[object] = []
    store.watch_listeners.append(lambda lost: failures.append(lost))
    events: list[object] = []

    async def follow() -> None:
        async for event in store.watch_prefixes(("o/a/", "o/b/"), 1):
            events.append(event)

    task = asyncio.create_task(follow())
    try:
        await wait_for(lambda: isinstance(store, EtcdStore) and store._watch_calls, message="open")
        with caplog.at_level("INFO", logger="shoal.store.etcd"):
            own_etcd.stop()
            await wait_for(lambda: len([f for f in failures if f]) >= 3, 20, message="retries")
            own_etcd.start()
            await wait_for(lambda: failures and failures[-1] is None, 20, message="back")
        broke = [r for r in caplog.records if "broke" in r.getMessage()]
        assert len([r for r in broke if r.levelname == "INFO"]) == 1, broke
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()


async def test_watches_broken_at_once_are_handled_a_few_per_loop_turn(
    own_etcd: EtcdServer,
) -> None:
    """etcd going away breaks every watch at once: each one's failure (its log line, its
    listeners told, its backoff set up) ran in the same turn of the event loop (3,000
    namespaces: 200-300 ms). At most `OPENING_WATCHES` are handled per turn; all come
    back with etcd."""
    store = await open_store(own_etcd.url)
    assert isinstance(store, EtcdStore)
    count = 300
    turns = LoopTurns()
    store.watch_listeners.append(lambda lost: turns.note() if lost is not None else None)

    async def follow(i: int) -> None:
        async for _ in store.watch_prefixes((f"o/{i}/a/", f"o/{i}/b/"), 1):
            pass

    tasks = [asyncio.create_task(follow(i)) for i in range(count)]
    try:
        await wait_for(lambda: len(store._watch_calls) == count, 30, message="every watch open")
        own_etcd.stop()
        await wait_for(lambda: turns.on_loop >= count, 30, message="every watch broke")
        own_etcd.start()
        await wait_for(lambda: len(store._watch_calls) == count, 30, message="every one back")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.close()
    assert turns.most_per_turn <= etcd_watch.OPENING_WATCHES
