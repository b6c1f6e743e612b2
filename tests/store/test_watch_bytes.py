"""A watch whose consumer does not read holds at most `MAX_QUEUED_BYTES` of keys and values,
on every backend: values may be 1 MiB each, and 10,000 events queued (the count bound) were
10 GiB."""

from __future__ import annotations

import asyncio
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import pytest

from shoal.store import Put, Resync, open_store, sqlite_watch
from shoal.store import memory as memory_module
from shoal.store.base import MAX_QUEUED_BYTES, WatchQueue
from shoal.store.memory import MemoryStore
from shoal.store.sqlite import SQLiteStore
from tests.etcd_server import EtcdServer
from tests.helpers import wait_for

MIB = 1 << 20
VALUE = b"v" * MIB  # (one object put under every key: the store's bytes are counted, not held)


def queued_bytes(queue: asyncio.Queue[Any]) -> int:
    """The keys and values queued, summed over the queue (the test's own count)."""
    return sum(len(e.key) + len(e.value) for e in list(queue._queue) if isinstance(e, Put))  # type: ignore[attr-defined]


async def test_a_memory_watch_not_read_holds_at_most_its_bytes_then_resyncs() -> None:
    """What was wrong: 80 values of 1 MiB put past a watch not read were all queued (80 MiB;
    10,000 of them, the count bound, 10 GiB). Now past `MAX_QUEUED_BYTES` its backlog is
    dropped for a `Resync`, as past its count."""
    store = MemoryStore(f"memory://{uuid.uuid4().hex}")
    watch = store.watch("big/", (await store.get_prefix("big/")).revision + 1)
    await store.put("big/first", b"1")
    assert isinstance(await anext(watch), Put)
    ((_, queue, _),) = store._d.watchers
    held = []
    for i in range(80):
        await store.put(f"big/{i:03d}", VALUE)  # (each fanned out within the put)
        held.append(queued_bytes(queue))
    assert max(held) <= MAX_QUEUED_BYTES, f"{max(held) / MIB:.0f} MiB queued"
    assert isinstance(queue, WatchQueue) and queue.bytes == held[-1]
    event = await anext(watch)
    assert isinstance(event, Resync) and len(event.items) == 81
    await watch.aclose()
    await store.close()


async def test_a_memory_stores_history_keeps_at_most_its_bytes_and_a_watch_from_before_resyncs() -> (
    None
):
    """What was wrong: the history kept for watches from a past revision held its last
    100,000 changes whatever their size (of values of 1 MiB: 100 GiB). Now at most
    `HISTORY_BYTES`: a watch from before what it holds gets a `Resync`."""
    store = MemoryStore(f"memory://{uuid.uuid4().hex}")
    for i in range(80):
        await store.put(f"big/{i % 8}", VALUE)
    kept = sum(len(e.key) + len(getattr(e, "value", b"")) for e in store._d.history)
    assert kept == store._d.history_bytes <= memory_module.HISTORY_BYTES
    watch = store.watch("big/", 1)
    event = await anext(watch)
    assert isinstance(event, Resync) and len(event.items) == 8
    await watch.aclose()
    await store.close()


async def test_a_sqlite_watch_not_read_holds_at_most_its_bytes_and_reads_on_from_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was wrong: a poll read 2,048 changes whatever their size, and a watch not read
    was polled until 8,000 events waited for it: 24 values of 1 MiB were one read of 24 MiB,
    all queued. Now a poll reads `POLL_BYTES` at most and a watch with a poll's worth of
    bytes short of `MAX_QUEUED_BYTES` waits for its consumer, then reads on from the log
    (here with bounds of 8 and 2 MiB: the log holds 64 MiB)."""
    monkeypatch.setattr(sqlite_watch, "MAX_QUEUED_BYTES", 8 * MIB, raising=False)
    monkeypatch.setattr(sqlite_watch, "POLL_BYTES", 2 * MIB, raising=False)
    url = f"sqlite:///{tmp_path / 'store.db'}"
    writer = await SQLiteStore.open(url)
    watcher = await SQLiteStore.open(url)
    read: list[int] = []
    held: list[int] = []
    poll_read, poll_once = watcher._poll_read, watcher._poll_once

    def counted_read(plan: list[tuple[tuple[str, ...], int, bool]]) -> Any:
        result = poll_read(plan)
        read.append(sum(len(key) + len(value or b"") for _, key, value in result.changes))
        return result

    async def counted_poll() -> bool:
        behind = await poll_once()
        held.extend(queued_bytes(w.queue) for w in watcher._watchers)
        return behind

    monkeypatch.setattr(watcher, "_poll_read", counted_read)
    monkeypatch.setattr(watcher, "_poll_once", counted_poll)
    watch = watcher.watch("big/", (await watcher.get_prefix("big/")).revision + 1)
    try:
        await writer.put("big/first", b"1")
        assert isinstance(await anext(watch), Put)  # (not read from now on)
        for i in range(24):
            await writer.put(f"big/{i:02d}", VALUE)
        await wait_for(lambda: held and max(held) >= 6 * MIB, message="the queue fills")
        polls = len(held)
        await wait_for(lambda: len(held) >= polls + 3, message="three polls more")
        assert max(held) <= 8 * MIB, f"{max(held) / MIB:.1f} MiB queued"
        assert max(read) <= 2 * MIB, f"{max(read) / MIB:.1f} MiB read in one poll"
        keys = set()
        while len(keys) < 24:
            event = await asyncio.wait_for(anext(watch), 10)
            assert isinstance(event, Put), "read on from the log, not resynced"
            keys.add(event.key)
    finally:
        await watch.aclose()
        await writer.close()
        await watcher.close()


@pytest.mark.etcd
async def test_an_etcd_watch_left_unread_catches_up_a_fragment_at_a_time(
    own_etcd: EtcdServer,
) -> None:
    """An etcd watch holds no queue: what it has not read waits in etcd. What was wrong: a
    watch left unread past etcd's buffer while 250 values of 1 MiB were put was caught up
    in one response of what it missed: 232 MiB held at once (past 256 MiB, the most a
    message may have, the stream broke). Now etcd splits a response into fragments of
    `--max-request-bytes` (1.5 MiB). Counted by `tracemalloc` while it catches up."""
    writer = await open_store(own_etcd.url)
    reader = await open_store(own_etcd.url)
    watch = reader.watch("big/", (await reader.get_prefix("big/")).revision + 1)
    try:
        await writer.put("big/first", b"1")
        assert isinstance(await anext(watch), Put)  # (not read from now on)
        for i in range(250):
            await writer.put(f"big/{i % 8}", VALUE)
        tracemalloc.start()
        try:
            revisions = [(await asyncio.wait_for(anext(watch), 30)).revision for _ in range(250)]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert revisions == sorted(revisions) and len(set(revisions)) == 250
        assert peak <= MAX_QUEUED_BYTES, f"{peak / MIB:.0f} MiB held while catching up"
    finally:
        await watch.aclose()
        await writer.close()
        await reader.close()


@pytest.mark.etcd
async def test_an_etcd_watch_caught_up_by_replay_misses_no_change_of_a_revision_split_in_fragments(
    own_etcd: EtcdServer,
) -> None:
    """A watch of several prefixes catches up on what came before its watchers by a replay
    of etcd's history, which stopped once it saw etcd's revision at their creation. etcd
    splits a response into fragments by size (`--max-request-bytes` and 512 KiB: 2 MiB),
    not at revisions: the replay stopped at the first change of that revision, and lost
    the others, in the next fragment, for good (the watchers start after it). Here the
    last revision is a `put_many` of two values of 0.2 MiB after changes of 1 and 0.7 MiB:
    the response of the four is split between the two of the last revision."""
    a, b = "frag/a/", "frag/b/"
    store = await open_store(own_etcd.url)
    try:
        await store.put_many([(f"{a}{i}", b"small") for i in range(4)])
        since = (await store.get_prefix(a)).revision
        await store.put(f"{a}big", VALUE)
        await store.put(f"{a}large", b"l" * (MIB * 7 // 10))
        fifth = b"f" * (MIB // 5)
        await store.put_many([(f"{a}x", fifth), (f"{b}y", fifth)])  # (one revision)
        watch = store.watch_prefixes((a, b), since + 1)
        try:
            first = await asyncio.wait_for(anext(watch), 10)  # (its watchers are made)
            assert not isinstance(first, Resync), "caught up by a replay, not a listing"
            await store.put(f"{a}after", b"1")
            keys = [first.key]
            while f"{a}after" not in keys:
                event = await asyncio.wait_for(anext(watch), 10)
                assert not isinstance(event, Resync), "caught up by a replay, not a listing"
                keys.append(event.key)
        finally:
            await watch.aclose()
        assert keys == [f"{a}big", f"{a}large", f"{a}x", f"{b}y", f"{a}after"]
    finally:
        await store.close()
