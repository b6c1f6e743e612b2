"""The membership watch under load, on the real stores: bursts spread over seconds are
coalesced into few snapshot reads, and taint storms never hold the event loop."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shoal.cards import ModelCard
from shoal.discovery import Discovery, EndpointId
from shoal.membership import DiscoverySource, MembershipWatch, Selection
from shoal.membership.feed import ScopeWatch
from shoal.membership.watch import MAX_DELAY_SECONDS, QUIET_SECONDS, YIELD_EVERY
from shoal.store import Store, open_store
from tests.etcd_server import EtcdServer
from tests.helpers import LoopTurns, wait_for
from tests.membership.conftest import StartWatch
from tests.membership.support import CountingFeed, DrivenSource, add_endpoint

NAMESPACES = [f"ns-{i}" for i in range(20)]


@pytest.fixture(params=["sqlite", pytest.param("etcd", marks=pytest.mark.etcd)])
async def real_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """An empty SQLite or etcd store of the test's own (watch-all sees every key in it)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
    else:
        server: EtcdServer = request.getfixturevalue("own_etcd")
        url = server.url
    store = await open_store(url, connect_timeout=30)  # a fresh etcd on a loaded machine
    yield store
    await store.close()


@pytest.mark.parametrize(
    ("selection", "watches"),
    [(Selection.of((), watch_all=True), 1), (Selection.of(NAMESPACES), 20)],
    ids=["watch-all", "20-namespaces"],
)
async def test_a_burst_spread_over_a_second_is_coalesced_into_few_snapshot_reads(
    real_store: Store, selection: Selection, watches: int
) -> None:
    discovery = Discovery(real_store)
    feed = CountingFeed(discovery)
    source = DrivenSource()
    source.push(selection)
    watch = MembershipWatch(discovery, source, feed=feed)
    await watch.start()
    try:
        start = time.monotonic()
        written: list[float] = []
        for i in range(200):  # 400 writes, paced over ~1.2 s (10 endpoints per namespace)
            await asyncio.sleep(max(0.0, start + i * 0.006 - time.monotonic()))
            await add_endpoint(discovery, NAMESPACES[i % 20], i + 1)
            written.append(time.monotonic())
        spread = time.monotonic() - start
        # Per watch: the first listing, one read per maximum delay the burst lasts (the last
        # one when it settles), and one more for the tail a store's watch delivers after that
        # (SQLite's poller hands over what it found every 50 ms, so the last writes can land
        # after the settle read): 4 for writes paced over 1.2 s. A loaded machine writes slower
        # (etcd took 3.2 s for them on CI), and can pause the writer for longer than the quiet
        # period: each such pause ends a burst for real, and may cost one more read per watch.
        pauses = sum(1 for a, b in itertools.pairwise(written) if b - a > QUIET_SECONDS)
        max_reads = watches * (2 + math.ceil(spread / MAX_DELAY_SECONDS) + pauses)
        await wait_for(lambda: len(watch.view.endpoints) == 200, message="200 endpoints")
        assert len(feed.opened) == watches
        read_at = [round(t - start, 2) for t in feed.read_at]
        assert len(feed.reads) <= max_reads, (
            f"reads at {read_at}, writes over {spread:.2f}s with {pauses} pauses"
        )
        assert watch.status.count == 20
        assert watch.status.applied_revision == selection.revision
    finally:
        await watch.stop()


async def test_300_taint_updates_over_5000_endpoints_never_hold_the_event_loop(
    start_watch: StartWatch, discovery: Discovery, feed: CountingFeed
) -> None:
    keys = [await add_endpoint(discovery, f"ns-{i % 50}", i + 1) for i in range(5000)]
    source = DrivenSource()
    source.push(Selection.of((), watch_all=True))
    watch = await start_watch(source)
    assert len(watch.view.endpoints) == 5000
    views: list[object] = []
    watch.subscribe(views.append)
    reads = len(feed.reads)

    applied = LoopTurns().wrap(watch, "_on_change")  # events applied, per turn of the loop
    rebuilt = LoopTurns().wrap(watch, "_models_of")  # endpoints looked at to publish views
    for key in keys[:300]:
        await discovery.update_taints(key, ["draining"])
        await asyncio.sleep(0)  # the writer itself lets the loop run
    tainted = {(k.endpoint, k.instance_id) for k in keys[:300]}

    def all_tainted() -> bool:
        endpoints = watch.view.endpoints
        return all(endpoints[ref].taints == ("draining",) for ref in tainted)

    await wait_for(all_tainted, message="300 taints in the view")
    await applied.stop()
    await rebuilt.stop()
    # Counted, not timed: each taint applied once, in place, and only the endpoints it
    # changed rebuilt (never the 5,000), `YIELD_EVERY` at most of either in one turn.
    assert applied.on_loop == 300 and rebuilt.on_loop == 300
    assert applied.most_per_turn <= YIELD_EVERY and rebuilt.most_per_turn <= YIELD_EVERY
    assert len(views) < 30, len(views)  # coalesced, not one view per taint
    assert len(feed.reads) == reads  # taints are applied in place, never by a read


async def test_a_full_read_of_10000_endpoints_never_compares_them_all_in_one_turn(
    start_watch: StartWatch, discovery: Discovery, feed: CountingFeed
) -> None:
    """Each read of a scope compares its snapshot with the last one, endpoint by endpoint:
    10,000 endpoints under watch-all took 10-150 ms in one callback (22 ms when they all
    joined, 157 ms when equal models came as new objects), at every burst and every full
    reconciliation. Counted, not timed: the endpoint ids hashed per turn of the loop."""
    for i in range(10_000):
        await add_endpoint(discovery, f"ns-{i % 100}", i + 1)
    watch = await start_watch(DiscoverySource(watch_all=True), reconcile_interval=0.1)
    assert len(watch.view.endpoints) == 10_000
    reads = len(feed.reads)
    hashed = LoopTurns().wrap(EndpointId, "__hash__")
    try:
        await wait_for(lambda: len(feed.reads) >= reads + 2, message="two full reads")
    finally:
        await hashed.stop()
    assert hashed.on_loop >= 2 * 10_000  # (each read looked at every endpoint)
    assert hashed.most_per_turn <= 4 * 4 * YIELD_EVERY, hashed.most_per_turn


async def test_a_swap_of_1024_namespaces_closes_the_old_scopes_a_slice_per_turn(
    start_watch: StartWatch, discovery: Discovery
) -> None:
    """The scopes a new selection dropped were closed all at once: each closed watch's tasks
    then ran in the same turn of the loop (4,096 namespaces swapped: 11,600 callbacks ready
    at once, the loop held 1-1.3 s). Counted, not timed: the watches closed per turn."""
    old, new = [f"a{i}" for i in range(1024)], [f"b{i}" for i in range(1024)]
    source = DrivenSource()
    source.push(Selection.of(old))
    watch = await start_watch(source)
    closed = LoopTurns().wrap(ScopeWatch, "close")
    swap = Selection.of(new)
    source.push(swap)
    try:
        await wait_for(lambda: closed.on_loop == 1024, timeout=30, message="old scopes closed")
    finally:
        await closed.stop()
    assert watch.status.applied_revision == swap.revision
    assert closed.most_per_turn <= YIELD_EVERY, closed.most_per_turn


async def test_a_burst_of_new_endpoints_decodes_each_card_once(
    start_watch: StartWatch, discovery: Discovery
) -> None:
    """Every model card put while the scope was not being read was decoded on the event loop
    to look for a taint update, before looking up whether its endpoint was known at all: each
    new card (10,000 namespaces appearing at once) was decoded twice, once for nothing."""
    watch = await start_watch(DiscoverySource(watch_all=True))
    decoded = LoopTurns().wrap(ModelCard, "from_json")
    try:
        for i in range(500):
            await add_endpoint(discovery, f"ns-{i}", i + 1)
        await wait_for(lambda: len(watch.view.endpoints) == 500, message="500 endpoints")
    finally:
        await decoded.stop()
    assert decoded.on_loop + decoded.off_loop <= 500 + 50, decoded.on_loop  # (the reads')
