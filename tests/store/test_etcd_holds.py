"""The etcd store never holds the event loop over a whole batch of etcd's: what etcd sends
in one message (a watch's catch-up from history, a replayed listing of what changed) is
converted a slice at a time (`CONVERT_SLICE`) between turns of the loop."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from shoal.store import Store, etcd_txn, open_store
from shoal.store.etcd import EtcdStore
from tests.etcd_server import EtcdServer
from tests.helpers import LoopTurns

pytestmark = pytest.mark.etcd

KEYS = 5000


@pytest.fixture
async def store(etcd_server: EtcdServer) -> AsyncIterator[Store]:
    s = await open_store(etcd_server.url)
    yield s
    await s.close()


@pytest.fixture
def prefix() -> str:
    return f"holds/{os.urandom(6).hex()}/"


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
