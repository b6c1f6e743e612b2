"""Discovery on a real etcd: the join of cards and instances across etcd restarts."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import aetcd
import aiohttp
import pytest

from shoal.bounds import first_listed
from shoal.discovery import Added, Discovery, ModelKey, Query, Removed
from shoal.store import open_store
from tests.discovery.test_discovery import EP, make_card, register
from tests.etcd_server import EtcdServer
from tests.helpers import wait_for
from tests.processes import Processes

pytestmark = pytest.mark.etcd

TTL = 1.0
"""Shorter than the gap between two watches reconnecting (their backoff reaches 2 s)."""
OUTAGE = 3.0
"""How long etcd stays down: long enough for watch backoffs to grow apart (the scenario's
length, not a synchronisation)."""


async def test_a_live_worker_never_loses_its_model_across_etcd_restarts(
    processes: Processes, own_etcd: EtcdServer
) -> None:
    """etcd restarts for longer than the worker's lease TTL: the worker re-grants, re-puts
    its instance and card under the new lease and retires the old one a TTL later. A
    watcher must never see the model without a routable instance meanwhile: it reads
    instances and cards as one (one watch, one revision), never one ahead of the other."""
    worker = await processes.worker(
        own_etcd.url, "--lease-ttl", f"{TTL:g}", "--ttft-ms", "0", "--itl-ms", "1"
    )
    store = await open_store(own_etcd.url)
    live: dict[ModelKey, str] = {}
    dropped: list[str] = []

    async def follow() -> None:
        async for event in Discovery(store).list_and_watch():
            if isinstance(event, Added):
                live[event.model.key] = event.model.card.display_name
            elif isinstance(event, Removed):
                gone = live.pop(event.key, None)
                if gone is not None and gone not in live.values():
                    dropped.append(f"{event.key} left with no other instance of {gone}")

    follower = asyncio.create_task(follow())
    try:
        await wait_for(lambda: list(live.values()) == ["mock-llm"], message="model listed")
        async with aiohttp.ClientSession() as http:
            for restart in range(4):
                (before,) = live
                down = time.monotonic()
                own_etcd.stop()
                try:
                    # The worker counts its lease lost: no renewal for a whole TTL.
                    await wait_for(
                        lambda: _lease_lost(http, worker.status_url),
                        timeout=TTL + 5,
                        message="the worker reports its lease lost",
                    )
                    # the outage's length, under test (OUTAGE in all)
                    await asyncio.sleep(max(0.0, down + OUTAGE - time.monotonic()))
                finally:
                    await asyncio.to_thread(own_etcd.start)
                await wait_for(
                    lambda before=before: len(live) == 1 and before not in live,
                    timeout=TTL * 3 + 5,
                    message=f"restart {restart}: the worker listed under its new lease only",
                )
                assert not dropped, dropped
        assert worker.proc.returncode is None
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await store.close()


async def _lease_lost(http: aiohttp.ClientSession, status_url: str) -> bool:
    async with http.get(status_url + "/health") as resp:
        return resp.status == 503 and "lost" in await resp.text()


async def test_a_key_only_an_outside_writer_could_put_never_fails_a_listing(
    own_etcd: EtcdServer,
) -> None:
    """A key under discovery's prefix that the store itself refuses (a space in it, put
    with etcdctl): skipped as malformed in the first listing, and in every pass after,
    also when a pass lists it without its value (it cannot be read alone): never a pass
    that fails, nor one that lists the fleet again from nothing. (An etcd of its own:
    the namespace's keys are the test's alone.)"""
    store = await open_store(own_etcd.url)
    disc = Discovery(store)
    try:
        first = await register(disc, EP, 0x10, make_card())
        host, port = own_etcd.url.removeprefix("etcd://").split(":")
        async with aetcd.Client(host=host, port=int(port)) as raw:
            await raw.put(b"shoal/v1/models/prod/backend/generate/10 copy", b"{}")
        assert [m.key for m in await disc.list()] == [first]
        for i in range(4):
            await register(disc, EP, 0x20 + i, make_card())
            for _ in range(10):  # (more revisions than keys listed: keys, then values)
                await store.put(f"elsewhere/{uuid.uuid4().hex}", b"1")
            assert len(await disc.list()) == 2 + i
        assert "shoal/v1/models/prod/backend/generate/10 copy" in disc.skipped
    finally:
        await store.close()


async def test_a_megabyte_key_from_another_writer_is_skipped_and_reported_cut(
    etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd takes keys up to its request bound (1.5 MiB); shoal's stores refuse keys over
    `MAX_KEY_BYTES`. An instance and a card at 1 MiB keys written by another writer are
    skipped and counted, and every report of them (the log, `skipped`, which `/health`
    lists) quotes the key cut: each was the whole megabyte, 100 of them a 100 MB `/health`."""
    namespace = f"bigkeys-{uuid.uuid4().hex[:8]}"
    client = aetcd.Client(host="127.0.0.1", port=etcd_server.client_port, timeout=5)
    await client.connect()
    store = await open_store(etcd_server.url)
    try:
        base = f"{namespace}/backend/generate/"
        await client.put(f"shoal/v1/instances/{base}{'b' * 2**20}".encode(), b"{}")
        await client.put(f"shoal/v1/models/{base}{'a' * 2**20}".encode(), make_card().to_json())
        discovery = Discovery(store)
        with caplog.at_level("INFO"):
            assert await discovery.list(Query(namespace=namespace)) == []
        assert len(discovery.skipped) == 2
        reported = first_listed(discovery.skipped)
        assert all(len(json.dumps(entry)) < 1024 for entry in reported), reported
        assert all("over the 1024-byte bound" in entry["reason"] for entry in reported)
        assert caplog.records and all(len(r.getMessage()) < 1024 for r in caplog.records)
    finally:
        # (keys no store may delete: the session's etcd is shared by the tests after this)
        await client.delete_prefix(f"shoal/v1/instances/{namespace}/".encode())
        await client.delete_prefix(f"shoal/v1/models/{namespace}/".encode())
        await store.close()
        await client.close()
