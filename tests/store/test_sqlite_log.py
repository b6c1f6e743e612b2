"""SQLite's change log under writers in several processes at once: what it keeps, and for
how long, so that the watches of other processes read changes, not a `Resync`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from shoal.store import Put, Resync
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
