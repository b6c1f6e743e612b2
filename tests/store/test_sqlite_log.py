"""SQLite's change log under writers in several processes at once: what it keeps, and for
how long, so that the watches of other processes read changes, not a `Resync`."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from shoal.store import Event, Put, Resync, sqlite_log, sqlite_watch
from shoal.store import sqlite as sqlite_module
from shoal.store.sqlite import SQLiteStore
from tests.helpers import wait_for
from tests.store.support import Recorder

ROOT = Path(__file__).resolve().parents[2]


def _writer(url: str, prefix: str, count: int, size: int) -> subprocess.Popen[str]:
    """A child process that puts `count` keys with one `put_many` once told to go."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.store.holder",
            url,
            "put-many",
            prefix,
            str(count),
            str(size),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
    )


async def _line(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout)
    assert line, f"writer exited: {proc.stderr.read() if proc.stderr else ''}"
    return line.strip()


async def test_a_watch_gets_every_key_of_three_processes_each_putting_10000_at_once(
    tmp_path: Path,
) -> None:
    """What was wrong: the log kept the last 1,000 revisions and each `put_many` paced only
    itself (10,000 keys a second): two or three workers re-putting their cards at once wrote
    the log through faster than another process's watch read it (a poll every 50 ms), which
    resynced its whole prefix 3-11 times. What holds now: a change stays in the log for
    `RETAIN_SECONDS` (within the caps), so the watch gets each key as its own `Put`."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    writers, count = 3, 10_000
    procs = [_writer(url, f"cards/w{n}/", count, 300) for n in range(writers)]
    watcher = await SQLiteStore.open(url)
    mirror: Recorder | None = None
    try:
        for proc in procs:
            assert await _line(proc) == "ready"
        snap = await watcher.get_prefix("cards/")
        mirror = Recorder(watcher.watch("cards/", snap.revision + 1))
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in procs:
            assert (await _line(proc)).startswith("done")
        recorder = mirror
        await wait_for(lambda: len(recorder.state) == writers * count, timeout=60)
        resyncs = recorder.of(Resync)
        assert not resyncs, f"{len(resyncs)} resyncs of the whole prefix"
        assert len(recorder.of(Put)) == writers * count
    finally:
        if mirror is not None:
            await mirror.close()
        await watcher.close()
        for proc in procs:
            proc.kill()
            proc.wait()


def _log(path: Path) -> tuple[int, int, int]:
    """The change log's rows, its bytes as counted in `meta`, and its bytes summed."""
    with sqlite3.connect(path) as conn:
        rows, summed = conn.execute(
            "SELECT count(*), coalesce(sum(length(key) + coalesce(length(value), 0)), 0)"
            " FROM changes"
        ).fetchone()
        (counted,) = conn.execute("SELECT log_bytes FROM meta").fetchone()
    return rows, counted, summed


async def test_the_caps_bound_the_log_even_when_every_change_is_young(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changes younger than `RETAIN_SECONDS` are kept, but never past `MAX_LOG_CHANGES` rows
    or `MAX_LOG_BYTES` bytes, whatever writes them (here single puts and deletes, which do
    not wait); the bytes are counted right; a watch that fell behind the cut resyncs."""
    monkeypatch.setattr(sqlite_log, "MAX_LOG_CHANGES", 2000)
    monkeypatch.setattr(sqlite_log, "MAX_LOG_BYTES", 100 * 1024)
    store = await SQLiteStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        start = await store.get_prefix("churn/")
        value = b"v" * 100
        for cap in ("bytes", "rows"):
            if cap == "rows":
                monkeypatch.setattr(sqlite_log, "MAX_LOG_BYTES", 1024 * 1024)
            for i in range(1500):
                await store.put(f"churn/{i % 40}", value)
                await store.delete(f"churn/{i % 40}")
            rows, counted, summed = _log(store.path)
            assert counted == summed, cap
            assert rows <= sqlite_log.MAX_LOG_CHANGES + sqlite_log.TRIM_EVERY, cap
            assert counted <= sqlite_log.MAX_LOG_BYTES + sqlite_log.TRIM_EVERY * 120, cap
        assert rows > sqlite_log.RETAIN_CHANGES  # (young: kept past the floor, to the cap)

        late = Recorder(store.watch("churn/", start.revision + 1))
        try:
            await wait_for(lambda: late.events, message="the watch from before the cut yields")
            assert isinstance(late.events[0], Resync) and late.events[0].items == []
        finally:
            await late.close()
    finally:
        await store.close()


@pytest.mark.parametrize("cap", ["rows", "bytes"])
async def test_writers_of_one_file_wait_for_room_rather_than_cut_a_young_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: str
) -> None:
    """The pace is the file's: two writers (two connections) each putting 1,500 keys at once
    into a log capped at 1,000 rows (or their bytes) wait, together, until the oldest change
    is `RETAIN_SECONDS` old before they cut it, and a watch gets every key as a `Put`."""
    if cap == "rows":
        monkeypatch.setattr(sqlite_log, "MAX_LOG_CHANGES", 1000)
    else:
        monkeypatch.setattr(sqlite_log, "MAX_LOG_BYTES", 1000 * len("cards/w0/00000" + "c" * 100))
    monkeypatch.setattr(sqlite_log, "RETAIN_SECONDS", 1.0)
    url = f"sqlite:///{tmp_path / 'store.db'}"
    writers = [await SQLiteStore.open(url) for _ in range(2)]
    watcher = await SQLiteStore.open(url)
    snap = await watcher.get_prefix("cards/")
    mirror = Recorder(watcher.watch("cards/", snap.revision + 1))
    try:
        started = time.monotonic()
        await asyncio.gather(
            *(
                w.put_many([(f"cards/w{n}/{i:05d}", b"c" * 100) for i in range(1500)])
                for n, w in enumerate(writers)
            )
        )
        took = time.monotonic() - started
        await wait_for(lambda: len(mirror.state) == 3000, timeout=30)
        assert not mirror.of(Resync)
        assert len(mirror.of(Put)) == 3000
        # 3,000 changes through a log of 1,000 kept 1 s each: at least two waits.
        assert took >= 2 * 1.0 * 0.9, took
        rows, counted, summed = _log(writers[0].path)
        assert rows <= 1000 and counted == summed <= 114_000
    finally:
        await mirror.close()
        for s in (*writers, watcher):
            await s.close()


async def test_a_watch_whose_consumer_lags_reads_on_from_the_log_without_a_resync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was wrong: a poll queued every change it read, and a watch with more than
    `MAX_QUEUED` events unread was dropped for a `Resync`, though the log still held them.
    Now a poll reads `POLL_MAX_CHANGES` at most and skips a watch with a slice's worth
    unread: it reads on from the log once its consumer catches up."""
    monkeypatch.setattr(sqlite_watch, "POLL_MAX_CHANGES", 200)
    monkeypatch.setattr(sqlite_watch, "MAX_QUEUED", 500)
    url = f"sqlite:///{tmp_path / 'store.db'}"
    writer = await SQLiteStore.open(url)
    watcher = await SQLiteStore.open(url)
    reads: list[int] = []
    polls: list[bool] = []
    poll_read, poll_once = watcher._poll_read, watcher._poll_once

    def counted_read(plan: list[tuple[tuple[str, ...], int, bool]]) -> Any:
        result = poll_read(plan)
        reads.append(len(result.changes))
        return result

    async def counted_poll() -> bool:
        polls.append(await poll_once())
        return polls[-1]

    monkeypatch.setattr(watcher, "_poll_read", counted_read)
    monkeypatch.setattr(watcher, "_poll_once", counted_poll)
    snap = await watcher.get_prefix("cards/")
    gate = asyncio.Event()
    events: list[Event] = []

    async def consume() -> None:
        async for event in watcher.watch("cards/", snap.revision + 1):
            events.append(event)
            await gate.wait()  # (the consumer lags: it reads nothing more until the gate)

    consumer = asyncio.create_task(consume())
    try:
        await writer.put("cards/first", b"1")
        await wait_for(lambda: events, message="the first event")
        await writer.put_many([(f"cards/{i:05d}", b"c" * 100) for i in range(2000)])
        (queue,) = [w.queue for w in watcher._watchers]
        await wait_for(lambda: queue.qsize() >= 500 - 200, message="the queue fills")
        seen = len(polls)
        await wait_for(lambda: len(polls) >= seen + 3, message="three polls more")
        assert queue.qsize() <= 500 and max(reads) <= 200
        gate.set()
        await wait_for(lambda: len(events) == 2001, timeout=30, message="every key")
        assert not any(isinstance(e, Resync) for e in events)
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await writer.close()
        await watcher.close()


async def test_a_file_of_the_previous_layout_gets_the_logs_column_and_byte_count(
    tmp_path: Path,
) -> None:
    """A file written before the log kept time (no `changes.at`, no `meta.log_bytes`, no
    triggers) gets them at open, its log counted; rows an older process writes (no `at`)
    keep the count right and count as old; a read-only client needs none of it."""
    path = tmp_path / "store.db"
    with sqlite3.connect(path) as conn:
        conn.executescript(
            """
            CREATE TABLE meta (id INTEGER PRIMARY KEY CHECK (id = 0),
              revision INTEGER NOT NULL, compact_revision INTEGER NOT NULL);
            INSERT INTO meta VALUES (0, 2, 0);
            CREATE TABLE kv (key TEXT PRIMARY KEY, value BLOB NOT NULL,
              mod_revision INTEGER NOT NULL, lease INTEGER NOT NULL DEFAULT 0,
              create_revision INTEGER NOT NULL DEFAULT 0);
            CREATE INDEX kv_by_lease ON kv (lease);
            CREATE TABLE leases (id INTEGER PRIMARY KEY, ttl REAL NOT NULL,
              deadline REAL NOT NULL, boot TEXT NOT NULL DEFAULT '',
              expires REAL NOT NULL DEFAULT 0);
            CREATE INDEX leases_by_deadline ON leases (deadline);
            CREATE TABLE changes (revision INTEGER PRIMARY KEY, key TEXT NOT NULL, value BLOB);
            INSERT INTO kv VALUES ('k/a', x'31', 1, 0, 1), ('k/b', x'3232', 2, 0, 2);
            INSERT INTO changes VALUES (1, 'k/a', x'31'), (2, 'k/b', x'3232');
            PRAGMA user_version = 2;
            """
        )
    reader = await SQLiteStore.open(f"sqlite:///{path}?mode=ro")  # (changes nothing)
    assert [kv.key for kv in (await reader.get_prefix("k/")).items] == ["k/a", "k/b"]
    await reader.close()
    store = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        assert _log(path) == (2, 9, 9)
        with sqlite3.connect(path) as conn:  # an older process writes (no `at`)
            conn.execute("UPDATE meta SET revision = 3")
            conn.execute("INSERT INTO changes (revision, key, value) VALUES (3, 'k/c', x'33')")
            conn.execute("INSERT INTO kv VALUES ('k/c', x'33', 3, 0, 3)")
        assert _log(path) == (3, 13, 13)
        await store.put_many([(f"k/{i:04d}", b"v") for i in range(sqlite_log.RETAIN_CHANGES + 100)])
        rows, counted, summed = _log(path)
        assert counted == summed
        with sqlite3.connect(path) as conn:  # (the old rows were trimmed: not young)
            assert conn.execute("SELECT count(*) FROM changes WHERE at = 0").fetchone() == (0,)
        assert rows > sqlite_log.RETAIN_CHANGES  # (the young ones kept past the floor)
    finally:
        await store.close()


async def test_a_change_stamped_ahead_of_the_clock_counts_as_old(tmp_path: Path) -> None:
    """A row whose `at` is ahead of the lease clock was written before a reboot (the
    monotonic clock restarts): it is trimmed as old, and never makes a writer wait."""
    path = tmp_path / "store.db"
    store = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        await store.put_many([(f"k/{i:05d}", b"v") for i in range(sqlite_log.RETAIN_CHANGES + 200)])
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE changes SET at = at + 1e9")
            now = sqlite_module.lease_clock()
            assert sqlite_log.wait_for_room(conn, now, 10**6, 0) == 0.0
            sqlite_log.trim(conn, conn.execute("SELECT revision FROM meta").fetchone()[0], now)
            (rows,) = conn.execute("SELECT count(*) FROM changes").fetchone()
        assert rows == sqlite_log.RETAIN_CHANGES
    finally:
        await store.close()


async def test_changes_that_come_of_age_are_trimmed_a_bounded_number_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of young changes, once old, is not deleted in one transaction (100,000 rows
    and their triggers held the write lock 0.5 s): `TRIM_OLD` per trim at most, until the
    log is back to its last `RETAIN_CHANGES` revisions."""
    path = tmp_path / "store.db"
    store = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        await store.put_many([(f"k/{i:05d}", b"v") for i in range(3000)])
    finally:
        await store.close()
    monkeypatch.setattr(sqlite_log, "RETAIN_SECONDS", 0.0)  # (every change is old now)
    monkeypatch.setattr(sqlite_log, "TRIM_OLD", 500)
    with sqlite3.connect(path, isolation_level=None) as conn:
        (revision,) = conn.execute("SELECT revision FROM meta").fetchone()
        held = [_log(path)[0]]
        while held[-1] > sqlite_log.RETAIN_CHANGES:
            sqlite_log.trim(conn, revision, sqlite_module.lease_clock())
            held.append(_log(path)[0])
            assert held[-2] - held[-1] == min(500, held[-2] - sqlite_log.RETAIN_CHANGES)
        assert held == [3000, 2500, 2000, 1500, 1000]
        assert _log(path)[1] == _log(path)[2]
