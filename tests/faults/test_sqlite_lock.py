"""Another process holds the SQLite store's write lock for longer than the lease TTL (a worker
killed meanwhile): requests keep being answered, and once the lock is released the fleet
converges, no ghost stays routable and the worker that stayed is routed again."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import aiohttp

from shoal.store import Store, open_store
from tests.faults.conftest import Fleet
from tests.faults.support import LEASE_TTL, RECONCILE_INTERVAL, Load, routes_exactly, until
from tests.faults.support import instance_ids as routed
from tests.processes import Processes

CONVERGE = LEASE_TTL + RECONCILE_INTERVAL + 10

LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""


async def routes_what_the_store_holds(frontend_url: str, store: Store) -> bool:
    """The frontend routes `mock-llm` to exactly the instances registered in the store."""
    snap = await store.get_prefix("shoal/v1/instances/")
    held = {int(kv.key.rsplit("/", 1)[1], 16) for kv in snap.items}
    return bool(held) and await routed(frontend_url) == held


async def health(url: str) -> dict[str, object]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as response:
        body: dict[str, object] = await response.json()
        return body


async def test_sqlite_locked_by_another_process_past_the_lease_ttl_then_released(
    processes: Processes, namespace: str, tmp_path: Path
) -> None:
    path = tmp_path / "store.db"
    fleet = Fleet(processes, f"sqlite:///{path}", namespace, tmp_path)
    store = await open_store(f"sqlite:///{path}")
    staying, dying = await fleet.worker(), await fleet.worker()
    front = await fleet.frontend()
    both = {staying.instance_id, dying.instance_id}
    await until(lambda: routes_exactly(front.url, both), 15, "both workers routed")
    load = Load([front.url])
    load.start()
    locker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LOCKER, str(path),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await load.advance(20)
        assert locker.stdout is not None and locker.stdin is not None
        assert (await asyncio.wait_for(locker.stdout.readline(), 10)).strip() == b"locked"
        locked = time.monotonic()
        dying.signal(signal.SIGKILL)
        await until(lambda: time.monotonic() - locked > 3 * LEASE_TTL, 15, "the lock held")
        await load.advance(20)
        during = await health(front.url)
        failed_while_locked = list(load.failed_before_first_byte)
        locker.stdin.close()
        await asyncio.wait_for(locker.wait(), 10)
        converge = await until(
            lambda: routes_what_the_store_holds(front.url, store), CONVERGE, "converged"
        )
        converged_at = len(load.failed_before_first_byte)
        await load.advance(20)
    finally:
        await load.finish()
        await store.close()
        if locker.returncode is None:
            locker.kill()
            await locker.wait()
    print(f"converged {converge:.2f} s after the lock; /health during it: {during.get('store')}")
    assert failed_while_locked == []  # the lock held 3 TTLs: every request answered
    # Released, the staying worker's lease is found expired (it could not renew it through
    # the lock) and reaped with its keys before it registers again under a new one: for that
    # moment the model has no instance, and requests are told so (404), as the lease contract
    # says. Nothing else fails, and nothing once the fleet converged.
    window = load.failed_before_first_byte[len(failed_while_locked) : converged_at]
    assert all("404" in f and "does not exist" in f for f in window), window
    assert load.failed_before_first_byte[converged_at:] == []
    live = await routed(front.url)
    # (the worker that stayed lost its lease to the lock, and re-registered under a new one)
    assert len(live) == 1 and dying.instance_id not in live
    assert staying.proc.returncode is None
