"""The SQLite watch poller under load from other processes: whatever the mix of writes (puts,
deletes, bursts past a poll's slice of changes and of bytes, keys of leases revoked or left
to expire, reaped by whoever can), every watch's view ends equal to the store. Watches are
added while the others are served, more of them than a poll looks at per turn of the loop
(`POLL_SLICE`), and one starts from a revision the log no longer holds."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.store import Delete, Put, Resync, open_store
from shoal.store.sqlite import SQLiteStore
from shoal.store.sqlite_watch import POLL_SLICE
from tests.helpers import wait_for
from tests.store.support import Recorder

ROOT = Path(__file__).resolve().parents[2]
PREFIXES = [f"s/{p}/" for p in range(6)]

WRITER = """
import asyncio, random, sys
from shoal.store import LeaseNotFoundError, open_store

async def main(url, seed, ops):
    rng = random.Random(int(seed))
    store = await open_store(url)
    prefixes = [f"s/{p}/" for p in range(6)]
    key = lambda: rng.choice(prefixes) + f"k{rng.randrange(40)}"
    for n in range(int(ops)):
        r, value = rng.random(), f"{seed}-{n}".encode()
        if r < 0.45:
            await store.put(key(), value)
        elif r < 0.65:
            await store.delete(key())
        elif r < 0.70:  # a burst: past a poll's POLL_MAX_CHANGES now and then
            many = rng.choice([50, 300, 2500])
            await store.put_many([(key() + f"-{i}", value) for i in range(many)])
        elif r < 0.71:  # large values: past a poll's POLL_BYTES
            await store.put_many([(key() + f"-big{i}", value * (600_000 // len(value)))
                                  for i in range(16)])
        elif r < 0.80:  # keys of a lease left to expire (reaped by whoever is alive)
            lease = await store.grant(rng.choice([0.2, 0.5]), keepalive=False)
            try:
                for i in range(3):
                    await store.put(key() + f"-l{i}", value, lease=lease.id)
            except LeaseNotFoundError:  # (expired already: the other writer held the file)
                pass
        elif r < 0.88:  # keys of a lease revoked
            lease = await store.grant(30.0, keepalive=False)
            for i in range(3):
                await store.put(key() + f"-r{i}", value, lease=lease.id)
            await store.revoke(lease.id)
        else:
            prefix = rng.choice(prefixes)
            listed = (await store.get_prefix(prefix)).items
            await store.delete_many([kv.key for kv in listed[: rng.randrange(1, 60)]])
        if n % 100 == 0:
            await asyncio.sleep(0.05)  # (leases expire meanwhile)
    # Left behind: keys of a lease that expires once every writer has gone.
    lease = await store.grant(30.0, keepalive=False)
    await store.put(f"s/0/last-{seed}", b"gone soon", lease=lease.id)
    await store.close()
    print("done", flush=True)

asyncio.run(main(*sys.argv[1:]))
"""


def seen(recorder: Recorder) -> set[str]:
    """The keys a watch has had: put, or in a `Resync`."""
    keys = {e.key for e in recorder.of(Put)}
    return keys.union(*({kv.key for kv in e.items} for e in recorder.of(Resync)))


def _spawn_writer(url: str, seed: int, ops: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, url, str(seed), str(ops)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["read-write", "read-only"])
async def test_every_watch_ends_equal_to_the_store_with_two_processes_writing(
    tmp_path: Path, mode: str
) -> None:
    """`read-only`: the watching process cannot reap, so the last lease, expired once both
    writers have gone, leaves its keys by a `Resync` alone (no revision moves)."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await (await SQLiteStore.open(url)).close()  # (the file, before a read-only open)
    store = await open_store(url + ("?mode=ro" if mode == "read-only" else ""))
    recorders: dict[str, list[Recorder]] = {p: [] for p in [*PREFIXES, "s/"]}

    async def follow(prefix: str, start: int | None = None) -> Recorder:
        snap = await store.get_prefix(prefix)
        if start is not None:  # (from far back: the log no longer holds it)
            recorder = Recorder(store.watch(prefix, start))
        else:
            initial = {kv.key: kv.value for kv in snap.items}
            recorder = Recorder(store.watch(prefix, snap.revision + 1), initial)
        recorders[prefix].append(recorder)
        return recorder

    idle = [Recorder(store.watch(f"idle/{i}/", 1)) for i in range(POLL_SLICE + 100)]
    first = [await follow(p) for p in [*PREFIXES, "s/"]]
    writers = [_spawn_writer(url, seed, 800) for seed in (1, 2)]
    try:
        # Watches added while the others are served, each after more has happened.
        for step in range(1, 9):
            await wait_for(
                lambda step=step: (
                    len(first[-1].events) >= 120 * step
                    or all(w.poll() is not None for w in writers)
                ),
                timeout=120,
                message="the writers' progress",
            )
            await follow(PREFIXES[step % len(PREFIXES)])
            if step == 4:
                await follow("s/", start=1)
        for writer in writers:
            out, _ = await asyncio.to_thread(writer.communicate, timeout=180)
            assert writer.returncode == 0 and out.strip() == "done", (writer.returncode, out)

        async def store_now() -> dict[str, dict[str, bytes]]:
            listed = {p: await store.get_prefix(p) for p in recorders}
            return {p: {kv.key: kv.value for kv in s.items} for p, s in listed.items()}

        # The keys of the writers' last leases (30 s to live: a watch still behind the
        # writers' backlog on a loaded machine sees them before they expire; 10 s was
        # too short with a load average of 4.7 on two cores) were seen,
        await wait_for(
            lambda: {"s/0/last-1", "s/0/last-2"} <= seen(first[0]),
            timeout=30,
            message="the last leases' keys seen",
        )

        # then those leases expire with nobody writing: their keys leave the store,
        async def last_gone() -> bool:
            return not any(k.startswith("s/0/last-") for k in (await store_now())["s/0/"])

        await wait_for(last_gone, timeout=60, message="the last lease's keys gone")

        # and every watch's view comes to equal the store, and stays so.
        async def views_equal() -> bool:
            truth = await store_now()
            return all(r.state == truth[p] for p, rs in recorders.items() for r in rs)

        await wait_for(views_equal, timeout=30, message="every watch's view equals the store")
        truth = await store_now()
        for prefix, rs in recorders.items():
            for r in rs:
                r.ordered_state()
                assert r.state == truth[prefix], prefix
        assert all(not r.state and not r.of(Put) and not r.of(Delete) for r in idle)
        assert sum(len(rs) for rs in recorders.values()) == 7 + 8 + 1
    finally:
        for writer in writers:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
        for r in [*idle, *(r for rs in recorders.values() for r in rs)]:
            await r.close()
        await store.close()
