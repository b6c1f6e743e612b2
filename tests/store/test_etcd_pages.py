"""The etcd store's listings, a page at a time: each page bounded in bytes (etcd has no byte
limit for a range), every key listed once, in key order, at one revision."""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

import pytest

from shoal.store import MAX_VALUE_BYTES, Store, etcd_client, etcd_txn, etcd_watch, open_store
from shoal.store.etcd import EtcdStore
from tests.etcd_server import EtcdServer
from tests.helpers import wait_for

pytestmark = pytest.mark.etcd


@pytest.fixture
def store(etcd_store: Store) -> Store:
    return etcd_store  # (`prefix`: tests/store/conftest.py's)


def record_pages(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of each listing response `store` receives from now on, in order."""
    assert isinstance(store, EtcdStore)
    call = store._call
    sizes: list[int] = []

    async def recorded(what: str, fn: Any) -> Any:
        answer = await call(what, fn)
        if what.startswith("get_prefixes"):  # (the message as it came, or parsed)
            sizes.append(len(answer) if isinstance(answer, bytes) else answer.ByteSize())
        return answer

    monkeypatch.setattr(store, "_call", recorded)
    return sizes


async def test_a_listing_of_large_values_comes_in_pages_bounded_in_bytes(
    store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 values of the largest size (`MAX_VALUE_BYTES`) among small ones: no page holds
    more than about `PAGE_BYTES` (it was one 40 MiB page: 16,384 of them would have been
    16 GiB, past any message limit), and the listing is every key, in order."""
    page_bytes = 16 * 1024 * 1024
    monkeypatch.setattr(etcd_txn, "PAGE_BYTES", page_bytes, raising=False)
    monkeypatch.setattr(etcd_watch, "HISTORY_REVISIONS", 0)
    big = os.urandom(MAX_VALUE_BYTES)
    written = {f"{prefix}b/{i:03d}": big for i in range(40)}
    written |= {f"{prefix}c/{i:04d}": b"s" * 100 for i in range(300)}
    for key, value in written.items():
        await store.put(key, value)
    sizes = record_pages(store, monkeypatch)

    snap = await store.get_prefix(prefix)

    assert [kv.key for kv in snap.items] == sorted(written)
    assert all(kv.value == written[kv.key] for kv in snap.items)
    assert max(sizes) <= page_bytes + 64 * 1024, sizes
    assert sum(sizes) >= 40 * MAX_VALUE_BYTES


async def test_a_listing_of_small_values_still_comes_in_pages_of_many_keys(
    store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cards of a few hundred bytes: the pages grow to `PAGE_KEYS` keys within a few pages
    (a cold start over 100,000 instances takes a few more pages)."""
    monkeypatch.setattr(etcd_txn, "PAGE_KEYS", 1000)
    await store.put_many([(f"{prefix}{i:05d}", b"c" * 300) for i in range(6000)])
    sizes = record_pages(store, monkeypatch)

    snap = await store.get_prefix(prefix)

    assert len(snap.items) == 6000
    assert len(sizes) <= 3 + 6  # (8, 128 keys, then 1,000 a page)


async def test_a_page_past_the_message_limit_is_read_again_smaller(
    etcd_server: EtcdServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Values that grow past the last page's estimate within one page: the client refuses
    the message (its receive limit), and the page is read again with fewer keys rather
    than the listing failing for good (a prefix holding more than the limit in one page
    could never be listed)."""
    options = dict(etcd_client._CHANNEL_OPTIONS)
    options["grpc.max_receive_message_length"] = 3 * 1024 * 1024
    monkeypatch.setattr(etcd_client, "_CHANNEL_OPTIONS", options)
    monkeypatch.setattr(etcd_txn, "PAGE_BYTES", 1024 * 1024, raising=False)
    store = await open_store(etcd_server.url)
    try:
        written = {f"{prefix}a/{i:04d}": b"s" * 10 for i in range(400)}
        written |= {f"{prefix}b/{i:03d}": os.urandom(256 * 1024) for i in range(24)}
        for key, value in written.items():
            await store.put(key, value)

        snap = await store.get_prefix(prefix)

        assert [kv.key for kv in snap.items] == sorted(written)
        assert all(kv.value == written[kv.key] for kv in snap.items)
    finally:
        await store.close()


async def test_a_listing_paginated_while_another_writer_deletes_and_adds_is_one_revision(
    etcd_server: EtcdServer, store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small pages (`PAGE_BYTES` of 64 KiB: about 60 keys) while another client deletes and
    adds keys all over the prefix: the listing is exactly the prefix's state at its revision
    (no key lost, none twice, none from after it), in key order."""
    monkeypatch.setattr(etcd_txn, "PAGE_BYTES", 64 * 1024, raising=False)
    monkeypatch.setattr(etcd_watch, "HISTORY_REVISIONS", 0)
    state = {f"{prefix}{i:05d}": os.urandom(1000) for i in range(0, 4000, 2)}
    await store.put_many(list(state.items()))
    start = (await store.get_prefix(prefix)).revision
    writer = await open_store(etcd_server.url)
    ops: list[tuple[int, str, bytes | None]] = []  # (revision, key, value or None: deleted)
    done = asyncio.Event()
    rng = random.Random(7)

    async def write() -> None:
        while not done.is_set():
            key = f"{prefix}{rng.randrange(4000):05d}"
            if rng.random() < 0.5:
                value = os.urandom(1000)
                ops.append((await writer.put(key, value), key, value))
            elif await writer.delete(key):
                ops.append(((await writer.get_prefix(key)).revision, key, None))

    task = asyncio.create_task(write())
    try:
        await wait_for(lambda: len(ops) >= 20, message="the writer is writing")
        snap = await store.get_prefix(prefix)
        await wait_for(lambda: ops[-1][0] > snap.revision + 20, message="writes after it")
    finally:
        done.set()
        await task
        await writer.close()

    assert snap.revision > start
    expected = dict(state)
    for revision, key, value in sorted(ops, key=lambda op: op[0]):
        if revision > snap.revision:
            break
        if value is None:
            expected.pop(key, None)
        else:
            expected[key] = value
    assert [kv.key for kv in snap.items] == sorted(expected)
    assert {kv.key: kv.value for kv in snap.items} == expected
    assert all(kv.mod_revision <= snap.revision for kv in snap.items)


async def test_values_growing_past_the_message_limit_cost_few_refused_pages(
    etcd_server: EtcdServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused page is one etcd made whole and sent (here 6 MiB; with 1.5 MiB values up
    to the range's whole rest): small values before large ones made the page grow back past
    the limit after each page of small ones (15 refused here). It is read again 16 times
    smaller until it fits (a refusal a step), and does not grow over the keys it refused."""
    options = dict(etcd_client._CHANNEL_OPTIONS)
    options["grpc.max_receive_message_length"] = 3 * 1024 * 1024
    monkeypatch.setattr(etcd_client, "_CHANNEL_OPTIONS", options)
    monkeypatch.setattr(etcd_txn, "PAGE_BYTES", 1024 * 1024, raising=False)
    store = await open_store(etcd_server.url)
    try:
        written = {f"{prefix}a/{i:04d}": b"s" * 10 for i in range(3000)}
        written |= {f"{prefix}b/{i:03d}": os.urandom(256 * 1024) for i in range(24)}
        await store.put_many(list(written.items()))
        assert isinstance(store, EtcdStore)
        call, refused = store._call, []

        async def counted(what: str, fn: Any) -> Any:
            try:
                return await call(what, fn)
            except Exception as exc:
                refused.append(etcd_client._grpc_code(exc)[0])
                raise

        monkeypatch.setattr(store, "_call", counted)
        snap = await store.get_prefix(prefix)
        assert [kv.key for kv in snap.items] == sorted(written)
        assert refused.count("RESOURCE_EXHAUSTED") <= 3, refused  # (a step each, 16x fewer keys)
    finally:
        await store.close()
