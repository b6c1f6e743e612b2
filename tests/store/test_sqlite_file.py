"""The SQLite store follows its file: one deleted or replaced under a process that has it
open (a state directory wiped, a backup moved in place) is not written on for ever."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shoal.store import LeaseNotFoundError, Resync
from shoal.store.sqlite import SQLiteStore
from tests.helpers import wait_for
from tests.store.support import Recorder


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
