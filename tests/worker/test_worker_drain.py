"""Drain bounds on real `shoal worker` processes: a second signal, --drain-timeout, a frozen store.

The worker promises: from the first SIGTERM/SIGINT to exit takes at most `--drain-timeout`
plus the cleanup budget (`CLEANUP_BUDGET`, shared by every store call of the drain); a
second signal ends the wait for in-flight requests at once but still withdraws the keys
and revokes the lease; exit is 0 with no traceback.
"""

from __future__ import annotations

import signal
import sqlite3
import time

import aiohttp
import pytest

from shoal.discovery import Discovery
from shoal.store import Store
from shoal.worker.runtime import CLEANUP_BUDGET
from tests.helpers import wait_for
from tests.worker.conftest import StartWorker
from tests.worker.test_worker_lifecycle import _all_tainted, chat

SLACK = 1.5
"""Seconds for process start-up/teardown and a loaded test machine."""


async def read_until_closed(resp: aiohttp.ClientResponse) -> str:
    """The rest of a streamed response; a cut stream ends the read, not the test."""
    try:
        return (await resp.read()).decode()
    except aiohttp.ClientError:
        return ""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_second_signal_shortens_the_drain_but_still_withdraws_and_revokes(
    sig: signal.Signals, start_worker: StartWorker, store: Store
) -> None:
    worker = await start_worker(
        "--ttft-ms", "0", "--itl-ms", "20", "--drain-timeout", "60", "--lease-ttl", "60"
    )
    discovery = Discovery(store)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(worker.url + "/v1/chat/completions", json=chat(5000))
        await resp.content.readuntil(b"\n\n")
        worker.signal(sig)
        await wait_for(lambda: _all_tainted(discovery), timeout=5, message="tainted draining")
        second = time.monotonic()
        worker.signal(sig)
        code = await worker.wait(CLEANUP_BUDGET + SLACK + 5)
        elapsed = time.monotonic() - second
        rest = await read_until_closed(resp)
    assert code == 0, worker.stderr()
    assert elapsed < CLEANUP_BUDGET + SLACK, elapsed
    assert "Traceback" not in worker.stderr(), worker.stderr()
    assert not rest.endswith("data: [DONE]\n\n"), "the stream was cut short"
    assert (await store.get_prefix("shoal/v1/")).items == [], "keys withdrawn, lease revoked"


async def test_drain_timeout_bounds_the_stream_and_the_exit(
    start_worker: StartWorker, store: Store
) -> None:
    drain_timeout = 1.0
    worker = await start_worker(
        "--ttft-ms", "0", "--itl-ms", "20", "--drain-timeout", str(drain_timeout)
    )
    async with aiohttp.ClientSession() as http:
        resp = await http.post(worker.url + "/v1/chat/completions", json=chat(5000))
        await resp.content.readuntil(b"\n\n")
        signalled = time.monotonic()
        worker.signal(signal.SIGTERM)
        await read_until_closed(resp)
        cut = time.monotonic() - signalled
    assert await worker.wait(drain_timeout + CLEANUP_BUDGET + SLACK + 5) == 0
    exited = time.monotonic() - signalled
    assert cut < drain_timeout + SLACK / 2 + 0.5, f"stream cut after {cut:.1f}s"
    assert exited < drain_timeout + CLEANUP_BUDGET + SLACK, f"exit after {exited:.1f}s"
    assert (await store.get_prefix("shoal/v1/")).items == []


async def test_a_frozen_store_delays_the_exit_by_the_cleanup_budget_at_most(
    start_worker: StartWorker, store_url: str
) -> None:
    drain_timeout = 1.0
    worker = await start_worker("--drain-timeout", str(drain_timeout), "--lease-ttl", "60")
    lock = sqlite3.connect(store_url.removeprefix("sqlite://"), timeout=10, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")  # every write of the worker now waits for the lock
        signalled = time.monotonic()
        worker.signal(signal.SIGTERM)
        code = await worker.wait(30)
        exited = time.monotonic() - signalled
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert code == 0, worker.stderr()
    assert exited < drain_timeout + CLEANUP_BUDGET + SLACK, f"exit after {exited:.1f}s"
    assert "Traceback" not in worker.stderr(), worker.stderr()
