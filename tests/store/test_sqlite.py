"""What the SQLite backend adds to the contract: bounded files, watch latency, processes
sharing one file, and leases reaped by whichever client is alive."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.store import (
    Delete,
    Event,
    KeyRevision,
    KeyValue,
    LeaseNotFoundError,
    Put,
    Resync,
    StoreError,
    StoreUnavailableError,
    open_store,
    sqlite_log,
)
from shoal.store.sqlite import (
    BOOT_ID,
    BUILD_SLICE,
    DELTA_CHANGES,
    LISTING_INDEX,
    SQLiteStore,
)
from shoal.store.sqlite_log import RETAIN_CHANGES
from shoal.store.sqlite_watch import POLL_SLICE
from tests.helpers import LoopTurns, wait_for
from tests.store.support import Recorder

ROOT = Path(__file__).resolve().parents[2]

FILE_BOUND = 4 * 1024 * 1024
"""Main file + WAL after 10,000 put/delete cycles must stay under this."""


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
async def store(url: str) -> AsyncIterator[SQLiteStore]:
    s = await SQLiteStore.open(url)
    yield s
    await s.close()


def _file_size(path: Path) -> int:
    total = 0
    for suffix in ("", "-wal"):
        part = Path(str(path) + suffix)
        if part.exists():
            total += part.stat().st_size
    return total


async def test_churn_keeps_the_file_bounded_and_a_far_behind_watch_resyncs(
    store: SQLiteStore, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (Changes kept by number alone: the caps, which bound the log whatever the time kept,
    # are proved in test_sqlite_log.py.)
    monkeypatch.setattr(sqlite_log, "RETAIN_SECONDS", 0.0)
    await store.put("churn/gone", b"soon deleted")
    await store.put("churn/kept", b"stays")
    start = await store.get_prefix("churn/")
    live = Recorder(
        store.watch("churn/", start.revision + 1), {kv.key: kv.value for kv in start.items}
    )
    try:
        value = b"v" * 100
        for i in range(10_000):
            key = f"churn/{i % 50}"
            await store.put(key, value)
            await store.delete(key)
        await store.delete("churn/gone")
        final = await store.get_prefix("churn/")
        assert [kv.key for kv in final.items] == ["churn/kept"]
        assert final.revision - start.revision > RETAIN_CHANGES

        size = _file_size(store.path)
        assert size < FILE_BOUND, f"{size} bytes after 10,000 put/delete cycles"

        # A watch far behind the retained log gets the full state, not a log with holes.
        behind = Recorder(store.watch("churn/", start.revision + 1))
        try:
            await wait_for(lambda: behind.events, message="the far-behind watch yields")
            first = behind.events[0]
            assert isinstance(first, Resync)
            assert [kv.key for kv in first.items] == ["churn/kept"]
            assert first.revision >= final.revision
        finally:
            await behind.close()

        # The live watch ends in the right state, whether it kept up or had to resync.
        await wait_for(lambda: live.state == {"churn/kept": b"stays"}, timeout=20)
    finally:
        await live.close()


async def test_watch_sees_a_put_from_another_client_within_100ms(url: str) -> None:
    writer = await SQLiteStore.open(url)
    watcher = await SQLiteStore.open(url)
    try:
        snap = await watcher.get_prefix("lat/")
        recorder = Recorder(watcher.watch("lat/", snap.revision + 1))
        latencies = []
        for i in range(50):
            key = f"lat/{i}"
            sent = time.monotonic()
            await writer.put(key, b"x")

            def arrived(key: str = key) -> bool:
                return key in recorder.arrived

            await wait_for(arrived, timeout=5, interval=0.002)
            latencies.append(recorder.arrived[key] - sent)
        await recorder.close()
        p50 = statistics.median(latencies)
        assert p50 < 0.1, f"p50 {p50 * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms"
        assert max(latencies) < 1.0
    finally:
        await writer.close()
        await watcher.close()


CHILD = """
import asyncio, sys
from shoal.store import Put, Resync, open_store

async def main(url, prefix):
    store = await open_store(url)
    snap = await store.get_prefix(prefix + "parent/")
    await store.put(prefix + "child/hello", b"from child")
    async for event in store.watch(prefix + "parent/", snap.revision + 1):
        if isinstance(event, Resync):
            found = [(kv.key, kv.value) for kv in event.items]
        else:
            found = [(event.key, event.value)] if isinstance(event, Put) else []
        if found:
            key, value = found[0]
            print("saw", key, value.decode(), flush=True)
            break
    await store.close()

asyncio.run(main(*sys.argv[1:]))
"""


def _spawn_child(url: str, prefix: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, url, prefix],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )


class LookedAt(list[tuple[int, str, bytes | None]]):
    """A poll's changes, noting in `turns` each look at one of them (by index, or every
    one by going through them)."""

    def __init__(self, changes: list[tuple[int, str, bytes | None]], turns: LoopTurns) -> None:
        super().__init__(changes)
        self.turns = turns

    def __getitem__(self, index: Any) -> Any:
        got = super().__getitem__(index)
        self.turns.note(len(got) if isinstance(index, slice) else 1)
        return got

    def __iter__(self) -> Iterator[tuple[int, str, bytes | None]]:
        self.turns.note(len(self))
        return super().__iter__()


async def test_a_poll_fanning_changes_out_to_4096_watches_never_holds_the_event_loop(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frontend following 4,096 namespaces has two prefixes watched per namespace: one
    poll that reads 1,000 changes hands each watch its own without matching every change
    against every watch on the event loop (that held it ~0.6 s). Counted, not timed: the
    poll looks at each change a few times (to find them by key, to hand each out), never
    once per watch (4 million looks)."""
    store = await SQLiteStore.open(url)
    writer = await SQLiteStore.open(url)
    try:
        start = (await store.get_prefix("")).revision + 1
        for i in range(500):  # 1,000 changes: all kept in the change log
            await writer.put(f"shoal/v1/instances/ns-{i % 4096}/c/e/{i:x}", b"x")
            await writer.put(f"shoal/v1/models/ns-{i % 4096}/c/e/{i:x}/m", b"x")
        got = [0]

        async def follow(ns: str) -> None:
            prefixes = (f"shoal/v1/instances/{ns}/", f"shoal/v1/models/{ns}/")
            async for event in store.watch_prefixes(prefixes, start):
                assert isinstance(event, Put) and event.key.startswith(prefixes), event
                got[0] += 1

        looked = LoopTurns()
        read = store._poll_read

        def poll_read(plan: Any) -> Any:  # (in the store's thread: what it read is not looked at)
            result = read(plan)
            return dataclasses.replace(result, changes=LookedAt(result.changes, looked))

        monkeypatch.setattr(store, "_poll_read", poll_read)
        tasks = [asyncio.create_task(follow(f"ns-{n}")) for n in range(4096)]
        try:
            await wait_for(lambda: got[0] == 1000, timeout=30, message="every change delivered")
        finally:
            await looked.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert 1000 <= looked.on_loop <= 4 * 1000, looked.on_loop
    finally:
        await store.close()
        await writer.close()


async def test_an_idle_poll_never_looks_at_every_watch(
    store: SQLiteStore, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frontend following 4,096 namespaces through a sources file holds three watches per
    namespace (its own and the membership's): every poll, every 50 ms, looked at each of them
    on the event loop and in the store's thread while nothing had changed (12,288 idle
    watches: 20-50 ms of the loop per poll). An idle poll now reads the revision only.
    Counted, not timed: the watches a poll's plan holds, over polls with nothing new."""
    writer = await SQLiteStore.open(url)
    start = (await store.get_prefix("")).revision + 1
    got: dict[int, list[Event]] = {i: [] for i in range(2000)}

    async def follow(i: int) -> None:
        async for event in store.watch(f"ns-{i}/", start):
            got[i].append(event)

    planned, polls = [0], [0]
    read, poll = store._poll_read, store._poll_once

    def poll_read(plan: Any) -> Any:
        planned[0] += len(plan)
        return read(plan)

    async def poll_once() -> bool:
        polls[0] += 1
        return await poll()

    tasks = [asyncio.create_task(follow(i)) for i in range(2000)]
    try:
        await writer.put("ns-7/a", b"1")
        await wait_for(lambda: len(got[7]) == 1, message="the first change")
        monkeypatch.setattr(store, "_poll_read", poll_read)
        monkeypatch.setattr(store, "_poll_once", poll_once)
        await wait_for(lambda: polls[0] >= 10, message="ten polls")
        assert planned[0] == 0, f"{planned[0]} watches looked at by {polls[0]} idle polls"
        await writer.put("ns-1999/b", b"2")  # a change: the poll after it hands it out
        await wait_for(lambda: len(got[1999]) == 1, message="the next change")
        assert isinstance(got[1999][0], Put) and got[1999][0].key == "ns-1999/b"
        assert all(not events for i, events in got.items() if i not in (7, 1999))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await writer.close()


async def test_a_poll_of_8192_watches_looks_at_a_slice_of_them_per_turn_of_the_loop(
    store: SQLiteStore, url: str
) -> None:
    """A frontend swapping 4,096 namespaces for 4,096 others holds up to 24,576 watches while
    the new ones are added, and each addition calls for a poll of them all: each poll looked at
    every watch in one callback (up to 1 s of the loop, poll after poll). Counted, not timed:
    the watches' queues looked at per turn of the loop, over the polls that set them up and
    hand them a change each."""
    writer = await SQLiteStore.open(url)
    start = (await store.get_prefix("")).revision + 1
    got = [0]

    async def follow(i: int) -> None:
        async for event in store.watch(f"ns-{i}/", start):
            got[0] += isinstance(event, Put)

    looked = LoopTurns().wrap(asyncio.Queue, "qsize")  # (twice per watch and poll)
    tasks = [asyncio.create_task(follow(i)) for i in range(8192)]
    try:
        await writer.put_many([(f"ns-{i}/k", b"1") for i in range(0, 8192, 4)])
        await wait_for(lambda: got[0] == 2048, timeout=60, message="every watch served")
    finally:
        await looked.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await writer.close()
    assert looked.on_loop >= 2 * 8192  # (every watch was looked at)
    assert looked.most_per_turn <= 3 * POLL_SLICE, looked.most_per_turn


async def test_two_processes_sharing_the_file_see_each_others_writes(
    store: SQLiteStore, url: str
) -> None:
    proc = _spawn_child(url, "shared/")
    try:
        kv = await wait_for(lambda: store.get("shared/child/hello"), timeout=20)
        assert kv.value == b"from child"
        await store.put("shared/parent/hello", b"from parent")
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert line.split() == ["saw", "shared/parent/hello", "from", "parent"]
        assert await asyncio.to_thread(proc.wait, 20) == 0
    finally:
        proc.kill()
        proc.wait()


async def test_revisions_strictly_increase_across_clients(url: str) -> None:
    a = await SQLiteStore.open(url)
    b = await SQLiteStore.open(url)
    try:
        revisions = []
        for i in range(20):
            revisions.append(await (a if i % 2 else b).put(f"rev/{i % 3}", b"x"))
        assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)
        assert (await a.get_prefix("rev/")).revision == revisions[-1]
    finally:
        await a.close()
        await b.close()


async def test_expired_lease_is_reaped_by_a_client_other_than_the_holder(url: str) -> None:
    holder = await SQLiteStore.open(url)
    observer = await SQLiteStore.open(url)
    try:
        ttl = 0.5
        lease = await holder.grant(ttl, keepalive=False)
        granted = time.monotonic()
        await holder.put("reap/held", b"x", lease=lease.id)
        snap = await observer.get_prefix("reap/")
        recorder = Recorder(observer.watch("reap/", snap.revision + 1), {"reap/held": b"x"})
        await holder.close()  # the holder's reaper stops with it
        try:
            await wait_for(lambda: recorder.state == {}, timeout=5)
            assert time.monotonic() - granted <= ttl + 1.0
            assert any(isinstance(e, Delete) and e.key == "reap/held" for e in recorder.events)
        finally:
            await recorder.close()
        # The lease is gone for good: neither keepalive nor a put under it succeeds.
        assert await observer._keepalive(lease.id, ttl) is False
        with pytest.raises(LeaseNotFoundError):
            await observer.put("reap/again", b"x", lease=lease.id)
    finally:
        await holder.close()
        await observer.close()


async def test_an_outage_too_short_to_poll_still_resyncs_every_watch(url: str) -> None:
    watcher = await SQLiteStore.open(url)
    writer = await SQLiteStore.open(url)
    try:
        await writer.put("blink/a", b"1")
        snap = await watcher.get_prefix("blink/")
        recorder = Recorder(watcher.watch("blink/", snap.revision + 1), {"blink/a": b"1"})
        await writer.put("blink/b", b"2")
        await wait_for(lambda: "blink/b" in recorder.state, message="the watch is live")
        watcher.set_unreachable(True)
        with pytest.raises(StoreUnavailableError, match="unreachable"):
            await watcher.get_prefix("blink/")
        watcher.set_unreachable(False)
        await wait_for(lambda: any(isinstance(e, Resync) for e in recorder.events))
        await recorder.close()
    finally:
        await watcher.close()
        await writer.close()


async def test_close_ends_watches_and_refuses_calls(url: str) -> None:
    store = await SQLiteStore.open(url)
    snap = await store.get_prefix("c/")
    recorder = Recorder(store.watch("c/", snap.revision + 1))
    await store.put("c/1", b"x")
    await wait_for(lambda: recorder.events)
    await store.close()
    await asyncio.wait_for(recorder.task, 5)
    with pytest.raises(StoreUnavailableError, match="closed"):
        await store.put("c/2", b"x")


async def test_missing_parent_directories_are_created(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "store.db"
    store = await open_store(f"sqlite:///{path}")
    try:
        await store.put("k", b"v")
        assert path.exists()
    finally:
        await store.close()


@pytest.mark.parametrize("bad", ["sqlite://relative.db", "sqlite:///", "sqlite:"])
async def test_url_without_an_absolute_path_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="sqlite:///"):
        await SQLiteStore.open(bad)


async def test_a_value_stored_as_text_is_skipped_and_watches_go_on(
    store: SQLiteStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A row edited by hand (the sqlite3 CLI stores TEXT) is reported and skipped: it never
    stops the poller that serves every watch of the store."""
    await store.put("bad/k", b"blob")
    snap = await store.get_prefix("")
    mirror = Recorder(store.watch("", snap.revision + 1))
    other = Recorder(store.watch("good/", snap.revision + 1))
    try:
        with sqlite3.connect(store.path) as conn:  # a hand edit: TEXT in the log and the table
            conn.execute("UPDATE meta SET revision = revision + 1")
            (rev,) = conn.execute("SELECT revision FROM meta").fetchone()
            conn.execute(
                "INSERT INTO changes (revision, key, value) VALUES (?, 'bad/k', 'text')", (rev,)
            )
            conn.execute(
                "UPDATE kv SET value = 'text', mod_revision = ? WHERE key = 'bad/k'", (rev,)
            )
        await store.put("good/k", b"1")
        await wait_for(lambda: other.state == {"good/k": b"1"}, message="watches go on")
        await wait_for(lambda: "good/k" in mirror.state)
        assert not store._poller.done()
        assert [kv.key for kv in (await store.get_prefix("")).items] == ["good/k"]
        assert await store.get("bad/k") is None
        assert "not a BLOB" in caplog.text
    finally:
        await mirror.close()
        await other.close()


async def test_watches_end_with_an_error_if_the_poller_stops(store: SQLiteStore) -> None:
    mirror = Recorder(store.watch("p/", 1))
    await store.put("p/a", b"1")
    await wait_for(lambda: mirror.state == {"p/a": b"1"})
    store._poller.cancel()  # whatever stops it, its watches must not wait forever
    await wait_for(lambda: mirror.task.done(), timeout=5)
    assert isinstance(mirror.task.exception(), StoreError)
    with pytest.raises(StoreError, match="poller"):
        await anext(store.watch("p/", 1))


async def test_a_wall_clock_step_does_not_expire_a_healthy_lease(
    store: SQLiteStore, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process whose wall clock runs 12 s ahead (NTP step, VM resume) writes and reaps
    with the holder's 10 s lease still held: the key stays."""
    lease = await store.grant(10.0)
    await store.put("held/k", b"x", lease=lease.id)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 12.0)
    stepped = await SQLiteStore.open(url)
    try:
        await stepped.put("other/k", b"y")  # every write reaps first
        assert await stepped.get("held/k") is not None
        assert await store.get("held/k") is not None
    finally:
        await stepped.close()
        await lease.revoke()


async def test_a_version_1_file_is_migrated_and_both_versions_keep_their_leases(
    tmp_path: Path,
) -> None:
    """A file from before lease deadlines moved off the wall clock opens with its data (keys
    created at their last write, as best known). During the upgrade, a version-1 process's
    lease lives by its wall-clock deadline, and a version-1 reaper never ends a new lease."""
    path = tmp_path / "v1.db"
    now = time.time()
    with sqlite3.connect(path) as conn:
        for statement in (
            "PRAGMA journal_mode = WAL",
            "CREATE TABLE meta (id INTEGER PRIMARY KEY CHECK (id = 0),"
            " revision INTEGER NOT NULL, compact_revision INTEGER NOT NULL)",
            "INSERT INTO meta VALUES (0, 3, 0)",
            "CREATE TABLE kv (key TEXT PRIMARY KEY, value BLOB NOT NULL,"
            " mod_revision INTEGER NOT NULL, lease INTEGER NOT NULL DEFAULT 0)",
            "CREATE INDEX kv_by_lease ON kv (lease)",
            "CREATE TABLE leases (id INTEGER PRIMARY KEY, ttl REAL NOT NULL, deadline REAL NOT NULL)",
            "CREATE INDEX leases_by_deadline ON leases (deadline)",
            "CREATE TABLE changes (revision INTEGER PRIMARY KEY, key TEXT NOT NULL, value BLOB)",
            "INSERT INTO kv VALUES ('k/plain', x'31', 1, 0), ('k/live', x'32', 2, 7),"
            " ('k/dead', x'33', 3, 8)",
            f"INSERT INTO leases VALUES (7, 10.0, {now + 3600}), (8, 10.0, {now - 1})",
            "INSERT INTO changes VALUES (1, 'k/plain', x'31'), (2, 'k/live', x'32'),"
            " (3, 'k/dead', x'33')",
            "PRAGMA user_version = 1",
        ):
            conn.execute(statement)
    store = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        items = (await store.get_prefix("k/")).items
        assert [(kv.key, kv.create_revision) for kv in items] == [("k/live", 2), ("k/plain", 1)]
        lease = await store.grant(10.0, keepalive=False)
        with sqlite3.connect(path) as conn:  # what a version-1 reaper would end
            v1_reaped = conn.execute("SELECT id FROM leases WHERE deadline < ?", (time.time(),))
            assert lease.id not in {row[0] for row in v1_reaped}
    finally:
        await store.close()


@pytest.mark.skipif(not BOOT_ID, reason="no boot id on this system")
async def test_a_lease_from_an_earlier_boot_is_expired(store: SQLiteStore) -> None:
    """Deadlines are on this boot's monotonic clock; no holder survives a reboot."""
    lease = await store.grant(3600.0, keepalive=False)
    await store.put("boot/k", b"x", lease=lease.id)
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE leases SET boot = 'boot:an-earlier-boot' WHERE id = ?", (lease.id,))
    reader = await SQLiteStore.open(store.url)
    try:
        assert await reader.get("boot/k") is None
    finally:
        await reader.close()


def _expire_every_lease(path: Path) -> None:
    """What the lease clock says once the holders are long dead, written by hand."""
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE leases SET expires = 0")


async def _dead_and_live_registrations(url: str) -> None:
    """In the file at `url`: a worker whose lease expired with nobody left to reap it, and
    one registered without a lease."""
    from shoal.discovery import Discovery, EndpointId, InstanceInfo, ModelKey
    from tests.discovery.test_discovery import make_card

    writer = await SQLiteStore.open(url)
    try:
        disc = Discovery(writer)
        lease = await writer.grant(3600.0, keepalive=False)
        for instance_id, lease_id in ((0xDEAD, lease.id), (0x11FE, 0)):
            endpoint = EndpointId("ns", "c", "e")
            await disc.register_instance(
                InstanceInfo("ns", "c", "e", instance_id, "http://w", "http://s"), lease=lease_id
            )
            await disc.register_model(
                ModelKey(endpoint, instance_id), make_card(f"m{instance_id:x}"), lease=lease_id
            )
    finally:
        await writer.close()
    _expire_every_lease(Path(url.removeprefix("sqlite://")))


async def test_a_read_only_reader_reads_without_keys_of_an_expired_lease(url: str) -> None:
    """Reaping on read is an optimisation: a reader that cannot write (`?mode=ro`, or a file
    it may only read) still reads, and never returns a key whose lease has expired."""
    from shoal.discovery import Discovery

    await _dead_and_live_registrations(url)
    reader = await open_store(url + "?mode=ro")
    try:
        assert await reader.get("shoal/v1/instances/ns/c/e/dead") is None
        assert await reader.get("shoal/v1/instances/ns/c/e/11fe") is not None
        keys = [kv.key for kv in (await reader.get_prefix("shoal/v1/")).items]
        assert keys == ["shoal/v1/instances/ns/c/e/11fe", "shoal/v1/models/ns/c/e/11fe"]
        disc = Discovery(reader)
        assert [m.key.instance_id for m in await disc.list()] == [0x11FE]
        # A delta from the file's revision (nothing written since) still leaves them out.
        revision = (await reader.get_prefix("shoal/v1/")).revision
        delta = await reader.get_prefixes_changed(("shoal/v1/",), revision)
        assert delta.items == []
        assert delta.removed == ["shoal/v1/instances/ns/c/e/dead", "shoal/v1/models/ns/c/e/dead"]
        assert [m.key.instance_id for m in await disc.list()] == [0x11FE]
        with pytest.raises(StoreError, match="read-only"):
            await reader.put("k", b"v")
    finally:
        await reader.close()
    with pytest.raises(StoreUnavailableError, match="no store file"):
        await open_store(url.replace("store.db", "absent.db") + "?mode=ro")


async def test_a_read_that_cannot_reap_for_a_full_disk_still_succeeds(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shoal.store import sqlite as backend

    await _dead_and_live_registrations(url)

    def disk_full(conn: sqlite3.Connection, now: float) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(backend, "_reap", disk_full)
    reader = await open_store(url)
    try:
        assert await reader.get("shoal/v1/models/ns/c/e/dead") is None
        keys = [kv.key for kv in (await reader.get_prefix("shoal/v1/models/")).items]
        assert keys == ["shoal/v1/models/ns/c/e/11fe"]
    finally:
        await reader.close()


async def test_a_read_only_watch_drops_the_keys_of_a_lease_that_expires(url: str) -> None:
    """Nobody can reap (the holder is gone, the reader may not write): the watch still loses
    the key once its lease has expired, by a `Resync`."""
    holder = await SQLiteStore.open(url)
    lease = await holder.grant(0.5, keepalive=False)
    await holder.put("w/held", b"x", lease=lease.id)
    await holder.put("w/kept", b"y")
    await holder.close()
    reader = await open_store(url + "?mode=ro")
    try:
        snap = await reader.get_prefix("w/")
        recorder = Recorder(
            reader.watch("w/", snap.revision + 1), {kv.key: kv.value for kv in snap.items}
        )
        try:
            await wait_for(lambda: recorder.state == {"w/kept": b"y"}, timeout=5)
        finally:
            await recorder.close()
    finally:
        await reader.close()


async def test_without_a_boot_id_a_lease_from_before_a_reboot_expires_by_the_wall_clock(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no boot id the monotonic clock alone cannot tell a reboot (it restarts near 0):
    the wall clock bounds every lease too, generously (`WALL_CLOCK_SLACK`)."""
    from shoal.store import sqlite_leases as backend

    monkeypatch.setattr(backend, "BOOT", "boot:")
    monkeypatch.setattr(backend, "BOOT_ID", "")
    store = await SQLiteStore.open(url)
    try:
        lease = await store.grant(1.0, keepalive=False)
        await store.put("boot/k", b"x", lease=lease.id)
        # The previous boot ran long: its monotonic deadline is far ahead of this boot's clock.
        with sqlite3.connect(store.path) as conn:
            conn.execute("UPDATE leases SET expires = ?", (backend.lease_clock() + 1e6,))
        assert await store.get("boot/k") is not None  # no time has passed on the wall clock
        real = time.time
        later = 1.0 + getattr(backend, "WALL_CLOCK_SLACK", 0.0) + 1.0
        monkeypatch.setattr(time, "time", lambda: real() + later)  # the reboot took a while
        assert await store.get("boot/k") is None
    finally:
        await store.close()


def _intermediate_v2_file(path: Path, live: float, dead: float) -> None:
    """The layout two development builds wrote as version 2: leases with a `boot` id and a
    `deadline` on the monotonic clock, no `expires`."""
    with sqlite3.connect(path) as conn:
        for statement in (
            "PRAGMA journal_mode = WAL",
            "CREATE TABLE meta (id INTEGER PRIMARY KEY CHECK (id = 0),"
            " revision INTEGER NOT NULL, compact_revision INTEGER NOT NULL)",
            "INSERT INTO meta VALUES (0, 3, 0)",
            "CREATE TABLE kv (key TEXT PRIMARY KEY, value BLOB NOT NULL,"
            " mod_revision INTEGER NOT NULL, lease INTEGER NOT NULL DEFAULT 0,"
            " create_revision INTEGER NOT NULL DEFAULT 0)",
            "CREATE INDEX kv_by_lease ON kv (lease)",
            "CREATE TABLE leases (id INTEGER PRIMARY KEY, ttl REAL NOT NULL,"
            " deadline REAL NOT NULL, boot TEXT NOT NULL DEFAULT '')",
            "CREATE INDEX leases_by_deadline ON leases (deadline)",
            "CREATE TABLE changes (revision INTEGER PRIMARY KEY, key TEXT NOT NULL, value BLOB)",
            "INSERT INTO kv VALUES ('k/plain', x'31', 1, 0, 1), ('k/live', x'32', 2, 7, 2),"
            " ('k/dead', x'33', 3, 8, 3)",
            f"INSERT INTO leases VALUES (7, 3600.0, {live}, '{BOOT_ID}'),"
            f" (8, 10.0, {dead}, '{BOOT_ID}')",
            "INSERT INTO changes VALUES (1, 'k/plain', x'31'), (2, 'k/live', x'32'),"
            " (3, 'k/dead', x'33')",
            "PRAGMA user_version = 2",
        ):
            conn.execute(statement)


async def test_a_version_2_file_without_lease_expiry_is_migrated(tmp_path: Path) -> None:
    from shoal.store.sqlite import lease_clock

    path = tmp_path / "v2dev.db"
    now = lease_clock()
    _intermediate_v2_file(path, live=now + 3600, dead=now - 1)
    store = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        items = (await store.get_prefix("k/")).items
        assert [kv.key for kv in items] == ["k/live", "k/plain"]
        assert await store._keepalive(7, 3600.0) is True
        lease = await store.grant(10.0, keepalive=False)
        await store.put("k/new", b"4", lease=lease.id)
        assert await store.get("k/new") is not None
    finally:
        await store.close()
    # The current layout of version 2 opens as it is.
    again = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        assert [kv.key for kv in (await again.get_prefix("k/")).items] == [
            "k/live",
            "k/new",
            "k/plain",
        ]
    finally:
        await again.close()


def forget_the_change_log(path: Path, *, past: int = 0) -> None:
    """Trim the change log up to the file's revision, as a long run of writes does (and
    mark it trimmed `past` revisions beyond: a listing since the file's revision is then
    whole too)."""
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM changes")
        conn.execute("UPDATE meta SET compact_revision = revision + ? WHERE id = 0", (past,))


async def test_a_listing_of_what_changed_is_a_delta_read_from_the_change_log(
    store: SQLiteStore,
) -> None:
    """While the log reaches back to `since`, only what it names is read: the keys written
    since, as they are, and the keys gone since; whatever the number of keys unchanged."""
    lease = await store.grant(60.0, keepalive=False)
    for i in range(50):
        await store.put(f"k/unchanged/{i:02}", b"0")
    await store.put("k/deleted", b"1")
    await store.put("k/leased", b"2", lease=lease.id)
    since = await store.put("k/changed", b"3")
    await store.put("k/changed", b"3'")
    await store.delete("k/deleted")
    await store.put("k/new", b"4")
    await store.put("other/new", b"5")
    await lease.revoke()
    listing = await store.get_prefixes_changed(("k/",), since)
    assert listing.items == [
        KeyValue("k/changed", b"3'", since + 1, 0, since),
        KeyValue("k/new", b"4", since + 3, 0, since + 3),
    ]
    assert listing.removed == ["k/deleted", "k/leased"]
    assert listing.revision == since + 5


async def test_a_listing_of_what_changed_past_the_change_log_lists_every_key(
    store: SQLiteStore,
) -> None:
    """Once the log is trimmed past `since` the listing is whole: every key, the values
    written since, and the others without theirs."""
    await store.put("k/old", b"1")
    since = await store.put("k/older", b"2")
    await store.put("k/new", b"3")
    forget_the_change_log(store.path)
    listing = await store.get_prefixes_changed(("k/",), since)
    assert listing.removed is None
    assert listing.items == [
        KeyValue("k/new", b"3", since + 1, 0, since + 1),
        KeyRevision("k/old", since - 1, 0, since - 1),
        KeyRevision("k/older", since, 0, since),
    ]
    # The plan reads the listing index alone for a key whose value is left out.
    plan = store._conn.execute(
        "EXPLAIN QUERY PLAN SELECT key, mod_revision, lease, create_revision"
        f" FROM kv INDEXED BY {LISTING_INDEX} WHERE key >= 'k/' AND key < 'k0'"
    ).fetchall()
    assert "COVERING INDEX" in str(plan), plan


async def test_a_listing_of_what_changed_reads_no_more_of_the_log_than_a_delta_takes(
    store: SQLiteStore,
) -> None:
    """The log keeps every change of the last `RETAIN_SECONDS`, up to 100,000 of them; a
    delta reads them once per prefix (a frontend following 4,096 namespaces lists 8,192), so
    it is read only from the last `DELTA_CHANGES` revisions, as when the log kept no more:
    further back the listing is whole, though the log still reaches `since`."""
    since = await store.put("k/old", b"1")
    await store.put_many([(f"k/{i:05d}", b"v") for i in range(DELTA_CHANGES + 1)])
    with sqlite3.connect(store.path) as conn:
        (compacted,) = conn.execute("SELECT compact_revision FROM meta").fetchone()
    assert compacted < since  # (the log reaches `since`)
    listing = await store.get_prefixes_changed(("k/",), since)
    assert listing.removed is None
    assert len(listing.items) == DELTA_CHANGES + 2
    near = await store.get_prefixes_changed(("k/",), listing.revision - DELTA_CHANGES)
    assert near.removed == [] and len(near.items) == DELTA_CHANGES


async def test_a_listing_larger_than_a_build_slice_keeps_key_order_across_slices(
    store: SQLiteStore,
) -> None:
    """Rows are built a `BUILD_SLICE` at a time: a listing of several slices is the one a
    single pass would give, values and omissions in key order."""
    n = BUILD_SLICE * 2 + 7
    for i in range(n):
        await store.put(f"k/{i:06}", b"v")
    since = (await store.get_prefix("k/")).revision
    for i in range(0, n, 3):
        await store.put(f"k/{i:06}", b"w")
    forget_the_change_log(store.path)
    listing = await store.get_prefixes_changed(("k/",), since)
    assert [kv.key for kv in listing.items] == [f"k/{i:06}" for i in range(n)]
    assert [isinstance(kv, KeyValue) for kv in listing.items] == [i % 3 == 0 for i in range(n)]
    whole = await store.get_prefix("k/")
    assert [kv.key for kv in whole.items] == [f"k/{i:06}" for i in range(n)]
    assert [kv.value for kv in whole.items] == [b"w" if i % 3 == 0 else b"v" for i in range(n)]


async def test_a_file_from_before_the_listing_index_gets_it_and_old_writers_keep_it_current(
    tmp_path: Path,
) -> None:
    """The listing index is created at open in a version-2 file without it; a process of
    the earlier build, which neither creates nor reads it, goes on writing (SQLite keeps
    every index current), and a read-only client of a file without it lists all the same."""
    path = tmp_path / "before-index.db"
    store = await SQLiteStore.open(f"sqlite:///{path}")
    await store.put("k/a", b"1")
    await store.close()
    with sqlite3.connect(path) as conn:
        conn.execute(f"DROP INDEX {LISTING_INDEX}")  # the file as the earlier build left it
    forget_the_change_log(path, past=1)  # (a whole listing, which reads the index)
    reader = await SQLiteStore.open(f"sqlite:///{path}?mode=ro")
    try:
        listing = await reader.get_prefixes_changed(("k/",), 1)
        assert listing.items == [KeyRevision("k/a", 1, 0, 1)]
    finally:
        await reader.close()
    store = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        with sqlite3.connect(path) as conn:
            names = [n for (n,) in conn.execute("SELECT name FROM sqlite_master")]
            assert LISTING_INDEX in names
            # An earlier build's put, as it wrote one (it knows nothing of the index).
            conn.execute("UPDATE meta SET revision = 2, compact_revision = 0 WHERE id = 0")
            conn.execute(
                "INSERT INTO kv (key, value, mod_revision, lease, create_revision)"
                " VALUES ('k/b', x'32', 2, 0, 2)"
            )
            conn.execute("INSERT INTO changes (revision, key, value) VALUES (2, 'k/b', x'32')")
            conn.execute("UPDATE kv SET value = x'31', mod_revision = 3 WHERE key = 'k/a'")
            conn.execute("INSERT INTO changes (revision, key, value) VALUES (3, 'k/a', x'31')")
            conn.execute("UPDATE meta SET revision = 3, compact_revision = 3 WHERE id = 0")
        listing = await store.get_prefixes_changed(("k/",), 2)
        assert listing.items == [KeyValue("k/a", b"1", 3, 0, 1), KeyRevision("k/b", 2, 0, 2)]
        assert (await store.get_prefixes(("k/",))).revision == 3
    finally:
        await store.close()


async def test_a_version_2_file_of_an_unknown_layout_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "odd.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE kv (key TEXT PRIMARY KEY)")
        conn.execute("PRAGMA user_version = 2")
    with pytest.raises(StoreUnavailableError) as caught:
        await SQLiteStore.open(f"sqlite:///{path}")
    message = str(caught.value)
    assert "\n" not in message and "layout" in message and "value" in message, message


async def test_a_relative_url_path_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = await open_store("sqlite:///./rel.db")
    try:
        await store.put("k", b"v")
    finally:
        await store.close()
    assert (tmp_path / "rel.db").exists()


async def test_url_escapes_in_the_path_are_decoded(tmp_path: Path) -> None:
    store = await open_store(f"sqlite:///{tmp_path}/with%20space.db")
    try:
        await store.put("k", b"v")
    finally:
        await store.close()
    assert (tmp_path / "with space.db").exists()
    assert not [n for n in os.listdir(tmp_path) if "%20" in n]


@pytest.mark.parametrize(
    ("suffix", "named"),
    [("?mode=rw2", "mode"), ("?cache=shared", "cache"), ("#frag", "#"), ("%00x", "NUL")],
)
async def test_url_parameters_other_than_mode_ro_are_refused_in_one_line(
    tmp_path: Path, suffix: str, named: str
) -> None:
    with pytest.raises(ValueError, match=named) as caught:
        await open_store(f"sqlite:///{tmp_path}/s.db{suffix}")
    assert "\n" not in str(caught.value)
    assert not os.listdir(tmp_path)


@pytest.mark.skipif(not BOOT_ID, reason="no boot id on this system")
async def test_a_live_lease_granted_without_a_boot_id_is_not_expired_by_a_process_with_one(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that cannot read the boot id (a sandbox without /proc) shares the file with
    one that can: its live leases are judged on the clocks both share (the monotonic
    deadline and the wall-clock bound), not taken for another boot's and reaped at once."""
    from shoal.store import sqlite_leases as backend

    monkeypatch.setattr(backend, "BOOT", "boot:")
    monkeypatch.setattr(backend, "BOOT_ID", "")
    holder = await SQLiteStore.open(url)
    lease = await holder.grant(30.0, keepalive=False)
    await holder.put("boot/k", b"x", lease=lease.id)
    monkeypatch.undo()  # the reader has a boot id
    reader = await SQLiteStore.open(url)
    try:
        assert await reader.get("boot/k") is not None
        await reader.put("boot/other", b"a write reaps first")
        assert await reader.get("boot/k") is not None
    finally:
        await reader.close()
        await holder.close()
