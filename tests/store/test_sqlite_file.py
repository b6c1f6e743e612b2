"""The SQLite store follows its file: one deleted or replaced under a process that has it
open (a state directory wiped, a backup moved in place) is not written on for ever."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from shoal.store import KeyValue, LeaseNotFoundError, Resync, StoreUnavailableError, sqlite_file
from shoal.store.sqlite import SQLiteStore
from tests.helpers import wait_for
from tests.store.support import Recorder, as_held, held_after


def remove_store_file(path: Path, suffixes: tuple[str, ...] = ("", "-wal", "-shm")) -> None:
    for suffix in suffixes:
        Path(f"{path}{suffix}").unlink(missing_ok=True)


async def test_a_store_whose_file_was_deleted_opens_the_one_made_there_and_its_watches_resync(
    tmp_path: Path,
) -> None:
    """What was wrong: a process kept its connection to the deleted file (its inode lives on
    while open) and went on reading and writing there: its lease renewed, its keys listed to
    itself, while every process opening the path (a frontend, `shoal ls`) saw another, empty
    store, for good. What holds now: within about a second it opens the file at the path;
    what it held in the old one is gone (a lease not found: the holder re-puts), and its
    watches get a `Resync` of the new file."""
    path = tmp_path / "store.db"
    url = f"sqlite:///{path}"
    old = await SQLiteStore.open(url)
    new: SQLiteStore | None = None
    try:
        lease = await old.grant(30, keepalive=False)
        await old.put("k/held", b"1", lease=lease.id)
        snap = await old.get_prefix("k/")
        recorder = Recorder(old.watch("k/", snap.revision + 1), {"k/held": b"1"})
        remove_store_file(path)
        new = await SQLiteStore.open(url)
        await new.put("k/made-after", b"2")

        async def sees_the_new_file() -> bool:
            return await old.get("k/made-after") is not None

        await wait_for(sees_the_new_file, timeout=5, message="reads the file at the path")
        assert await old.get("k/held") is None
        with pytest.raises(LeaseNotFoundError):  # (the holder grants anew and re-puts)
            await lease.keepalive()
        await wait_for(
            lambda: recorder.state == {"k/made-after": b"2"}, timeout=5, message="resynced"
        )
        assert any(isinstance(e, Resync) for e in recorder.events)
        await old.put("k/by-old", b"3")
        assert await new.get("k/by-old") is not None  # (written where everyone reads)
        await recorder.close()
    finally:
        await old.close()
        if new is not None:
            await new.close()


async def test_a_file_moved_in_place_of_the_store_is_the_one_read(tmp_path: Path) -> None:
    """A backup restored by a rename (a new inode at the path) is what the store reads."""
    path = tmp_path / "store.db"
    store = await SQLiteStore.open(f"sqlite:///{path}")
    other_path = tmp_path / "restored.db"
    other = await SQLiteStore.open(f"sqlite:///{other_path}")
    try:
        await store.put("k/before", b"1")
        await other.put("k/restored", b"2")
        await other.close()
        os.replace(other_path, path)
        remove_store_file(path, ("-wal", "-shm"))

        async def reads_the_restored_file() -> bool:
            return await store.get("k/restored") is not None

        await wait_for(reads_the_restored_file, timeout=5, message="reads the restored file")
        assert await store.get("k/before") is None
    finally:
        await store.close()


async def test_a_path_that_cannot_be_looked_at_fails_calls_as_a_store_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was wrong: the look at the path (a `stat`) raised `OSError` past the store's
    boundary when the path could not be looked at (a symlink loop, a parent that became a
    file, a directory it may not search): a `put` raised a bare `OSError`, which callers that
    retry on `StoreError` (registrations, controllers) do not expect, and every watch poll
    logged a traceback. What holds now: such a call fails as `StoreUnavailableError`, and once
    the path is a file again the store follows it."""
    path = tmp_path / "store.db"
    store = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        await store.put("k/a", b"1")
        remove_store_file(path)
        path.symlink_to(path)  # (a loop: stat raises ELOOP)
        monkeypatch.setattr(sqlite_file, "FILE_CHECK_INTERVAL", 0.0)
        with pytest.raises(StoreUnavailableError):
            await store.put("k/b", b"2")
        with pytest.raises(StoreUnavailableError):
            await store.get("k/a")
        path.unlink()

        async def writes_the_file_at_the_path() -> bool:
            with contextlib.suppress(StoreUnavailableError):
                await store.put("k/c", b"3")
            return path.is_file() and await store.get("k/c") is not None

        await wait_for(writes_the_file_at_the_path, timeout=5, message="follows the new file")
    finally:
        await store.close()


async def test_a_file_replaced_while_the_store_opens_it_is_still_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was wrong: the store looked at which file it had opened after opening it, so a
    file moved in place between the two (a restore racing a worker's start, or its follow of
    an earlier replacement) was taken for the one open: the store stayed on the file it had
    opened, which no longer had a name, for good. What holds now: the file is looked at
    before it is opened, so a replacement in between is found at the next look."""
    path = tmp_path / "store.db"
    other_path = tmp_path / "restored.db"
    for where, key in ((path, "k/before"), (other_path, "k/restored")):
        made = await SQLiteStore.open(f"sqlite:///{where}")
        await made.put(key, b"1")
        await made.close()
    connect = sqlite_file._connect

    def connect_then_replace(*args: object, **kwargs: object) -> object:
        conn = connect(*args, **kwargs)  # type: ignore[arg-type]
        if other_path.exists():
            os.replace(other_path, path)
            remove_store_file(path, ("-wal", "-shm"))
        return conn

    monkeypatch.setattr(sqlite_file, "_connect", connect_then_replace)
    store = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        assert not other_path.exists()

        async def reads_the_restored_file() -> bool:
            return await store.get("k/restored") is not None

        await wait_for(reads_the_restored_file, timeout=5, message="reads the file at the path")
    finally:
        await store.close()


async def test_a_listing_since_a_revision_of_the_file_replaced_reads_every_value(
    tmp_path: Path,
) -> None:
    """What was wrong: after the store followed its path to another file (a backup restored,
    a store made anew), a listing of what changed since a revision read in the old file was
    answered from the new file's change log, as a delta (its revisions are another history's):
    a reader kept the keys only the old file had and missed those the new one had (discovery
    acts on that listing for up to `WHOLE_LISTING_EVERY`, 300 s), and a value at the same
    revision in both was left out as one the reader held. What holds now: a listing since a
    revision from before the store followed its file reads every value."""
    path = tmp_path / "store.db"
    other_path = tmp_path / "restored.db"
    store = await SQLiteStore.open(f"sqlite:///{path}")
    other = await SQLiteStore.open(f"sqlite:///{other_path}")
    try:
        await store.put("k/same", b"old")
        await store.put_many([(f"k/old{i}", b"o") for i in range(9)])
        listing = await store.get_prefixes_changed(["k/"], 0)
        held = {kv.key: kv for kv in listing.items if isinstance(kv, KeyValue)}
        since = listing.revision
        await other.put("k/same", b"new")  # (the same revision, another value)
        await other.put_many([(f"k/new{i}", b"n") for i in range(2 * since)])
        await other.close()
        os.replace(other_path, path)
        remove_store_file(path, ("-wal", "-shm"))

        async def reads_the_restored_file() -> bool:
            return await store.get("k/new0") is not None

        await wait_for(reads_the_restored_file, timeout=5, message="reads the restored file")
        changed = await store.get_prefixes_changed(["k/"], since)
        assert held_after(held, changed, since) == as_held(await store.get_prefix("k/"))
    finally:
        await store.close()


async def test_a_watch_from_a_revision_of_the_file_replaced_resyncs(tmp_path: Path) -> None:
    """What was wrong: a watch started after the store followed its path to another file,
    from a revision listed in the old one (list, the file replaced, then watch), was taken as
    a watch of the new file from that revision: its consumer kept the old file's keys and
    never got the new file's (a backup restored with fewer revisions: no event at all until
    the new file reached the old revision). What holds now: such a watch starts with a
    `Resync` of the new file."""
    path = tmp_path / "store.db"
    other_path = tmp_path / "restored.db"
    store = await SQLiteStore.open(f"sqlite:///{path}")
    other = await SQLiteStore.open(f"sqlite:///{other_path}")
    recorder: Recorder | None = None
    try:
        await other.put("k/restored", b"2")
        await other.close()
        await store.put_many([(f"k/old{i}", b"1") for i in range(20)])
        snap = await store.get_prefix("k/")
        os.replace(other_path, path)
        remove_store_file(path, ("-wal", "-shm"))

        async def reads_the_restored_file() -> bool:
            return await store.get("k/restored") is not None

        await wait_for(reads_the_restored_file, timeout=5, message="reads the restored file")
        recorder = Recorder(
            store.watch("k/", snap.revision + 1), {kv.key: kv.value for kv in snap.items}
        )
        await wait_for(
            lambda: recorder is not None and recorder.state == {"k/restored": b"2"},
            timeout=5,
            message="the watch holds the file's keys",
        )
    finally:
        if recorder is not None:
            await recorder.close()
        await store.close()
