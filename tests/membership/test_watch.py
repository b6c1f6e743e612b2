"""The membership watch: few snapshot reads for bursts, watch before list, selection changes
that touch only what changed, and a membership that survives source errors."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import pytest

from shoal.discovery import Discovery, ModelKey, Query
from shoal.membership import (
    ConfigError,
    DiscoverySource,
    Membership,
    MembershipError,
    MembershipWatch,
    Selection,
    SourceError,
)
from shoal.membership.feed import ScopeWatch
from tests.helpers import wait_for
from tests.membership.conftest import StartWatch
from tests.membership.support import (
    CountingFeed,
    DrivenSource,
    add_endpoint,
    remove_endpoint,
)

NAMESPACES = [f"ns-{i}" for i in range(20)]


def endpoints_of(view: Membership) -> set[tuple[str, int]]:
    return {(ref[0].namespace, ref[1]) for ref in view.endpoints}


def generations(watch: MembershipWatch, namespace: str) -> dict[int, int]:
    return {
        ref[1]: ep.generation
        for ref, ep in watch.view.endpoints.items()
        if ref[0].namespace == namespace
    }


@pytest.mark.parametrize(
    ("selection", "watches", "max_reads"),
    [
        (Selection.of((), watch_all=True), 1, 3),
        (Selection.of(NAMESPACES), 20, 60),
    ],
    ids=["watch-all", "20-namespaces"],
)
async def test_a_burst_of_200_endpoints_is_coalesced_into_few_snapshot_reads(
    start_watch: StartWatch,
    discovery: Discovery,
    feed: CountingFeed,
    selection: Selection,
    watches: int,
    max_reads: int,
) -> None:
    source = DrivenSource()
    source.push(selection)
    watch = await start_watch(source)
    for i in range(200):  # the replay: 10 endpoints in each of 20 namespaces
        await add_endpoint(discovery, NAMESPACES[i % 20], i + 1)
    await wait_for(lambda: len(watch.view.endpoints) == 200, message="200 endpoints in view")
    assert len(feed.opened) == watches
    assert len(feed.reads) <= max_reads, feed.reads
    assert watch.status.count == 20
    assert watch.view.namespaces == set(NAMESPACES)
    assert watch.status.applied_revision == selection.revision


async def test_a_selection_change_keeps_unchanged_watches_epochs_and_generations(
    start_watch: StartWatch, discovery: Discovery, feed: CountingFeed
) -> None:
    for ns, ident in [("a", 1), ("b", 2), ("b", 3), ("c", 4)]:
        await add_endpoint(discovery, ns, ident)
    source = DrivenSource()
    first = Selection.of(["a", "b"])
    source.push(first)
    watch = await start_watch(source)
    assert endpoints_of(watch.view) == {("a", 1), ("b", 2), ("b", 3)}
    epoch_b, generations_b = watch.epochs()["b"], generations(watch, "b")

    second = Selection.of(["b", "c"])
    source.push(second)
    await wait_for(lambda: watch.status.applied_revision == second.revision)
    assert endpoints_of(watch.view) == {("b", 2), ("b", 3), ("c", 4)}
    assert watch.epochs()["b"] == epoch_b
    assert generations(watch, "b") == generations_b
    assert [q.namespace for q in feed.opened] == ["a", "b", "c"]  # b was never reopened
    assert watch.status.count == 2


async def test_instance_removed_while_the_watch_opens_is_absent_from_the_first_view(
    start_watch: StartWatch, discovery: Discovery
) -> None:
    leaving = await add_endpoint(discovery, "a", 1)
    await add_endpoint(discovery, "a", 2)

    class RemovingFeed(CountingFeed):
        async def open(self, query: Query, revision: int | None = None) -> ScopeWatch:
            opened = await super().open(query, revision)
            await remove_endpoint(discovery, leaving)  # leaves while the watch opens
            return opened

    views: list[Membership] = []
    source = DrivenSource()
    source.push(Selection.of(["a"]))
    watch = MembershipWatch(discovery, source, feed=RemovingFeed(discovery))
    watch.subscribe(views.append)
    await watch.start()
    try:
        assert endpoints_of(views[0]) == {("a", 2)}
        assert endpoints_of(watch.view) == {("a", 2)}
    finally:
        await watch.stop()


async def test_a_source_error_keeps_the_membership_until_an_empty_selection_clears_it(
    start_watch: StartWatch, discovery: Discovery
) -> None:
    await add_endpoint(discovery, "a", 1)
    source = DrivenSource()
    selected = Selection.of(["a"])
    source.push(selected)
    watch = await start_watch(source)
    before = watch.view

    source.push(SourceError("sources file: version must be 1, got 2"))
    await wait_for(lambda: watch.status.last_error is not None)
    assert watch.status.last_error == "sources file: version must be 1, got 2"
    assert watch.view is before
    assert watch.status.applied_revision == selected.revision
    assert watch.status.desired_revision is None  # cleared: the source offers nothing valid

    empty = Selection.of([])
    source.push(empty)
    await wait_for(lambda: watch.status.applied_revision == empty.revision)
    assert watch.view.endpoints == {} and watch.status.count == 0
    assert watch.status.last_error is None


async def test_taints_are_applied_in_place_and_unchanged_views_are_not_published(
    start_watch: StartWatch, discovery: Discovery, feed: CountingFeed
) -> None:
    tainted = await add_endpoint(discovery, "a", 1)
    await add_endpoint(discovery, "a", 2)
    views: list[Membership] = []
    now = [0.0]  # the clock of the full reconciliation
    source = DrivenSource()
    source.push(Selection.of(["a"]))
    watch = await start_watch(source, retry_tick=0.02, clock=lambda: now[0])
    watch.subscribe(views.append)
    untouched = generations(watch, "a")[2]
    reads = len(feed.reads)

    await discovery.update_taints(tainted, ["draining"])
    await wait_for(lambda: views and views[-1].endpoints[_ref(tainted)].taints == ("draining",))
    assert len(feed.reads) == reads  # no snapshot read for a taint update
    assert len(views) == 1
    assert generations(watch, "a")[2] == untouched
    # A full reconciliation reads every scope again; an unchanged view is not sent again.
    now[0] += 30
    await wait_for(lambda: len(feed.reads) > reads)
    now[0] += 30
    await wait_for(lambda: len(feed.reads) > reads + 1)
    assert len(views) == 1


def _ref(key: ModelKey) -> tuple[object, int]:
    return (key.endpoint, key.instance_id)


async def test_endpoint_prefixes_filter_namespaces_as_they_are_added_and_removed(
    start_watch: StartWatch, discovery: Discovery
) -> None:
    await add_endpoint(discovery, "a", 1, component="backend")
    await add_endpoint(discovery, "a", 2, component="other")
    await add_endpoint(discovery, "b", 3, component="other")
    source = DrivenSource()
    source.push(Selection.of(["a"]))
    watch = await start_watch(source, endpoint_prefixes=["a.backend", "b.other.generate"])
    assert endpoints_of(watch.view) == {("a", 1)}
    assert watch.view.scopes == {"a": (Query("a", "backend"),)}

    added = Selection.of(["a", "b"])
    source.push(added)
    await wait_for(lambda: watch.status.applied_revision == added.revision)
    assert endpoints_of(watch.view) == {("a", 1), ("b", 3)}
    removed = Selection.of(["b"])
    source.push(removed)
    await wait_for(lambda: watch.status.applied_revision == removed.revision)
    assert endpoints_of(watch.view) == {("b", 3)}
    assert watch.view.scopes == {"b": (Query("b", "other", "generate"),)}


async def test_watch_all_with_prefixes_derives_namespaces_and_counts_every_one_seen(
    start_watch: StartWatch, discovery: Discovery, feed: CountingFeed
) -> None:
    await add_endpoint(discovery, "a", 1)
    await add_endpoint(discovery, "b", 2)
    source = DiscoverySource(watch_all=True, endpoint_prefixes=["b"])
    watch = await start_watch(source, endpoint_prefixes=source.endpoint_prefixes)
    assert endpoints_of(watch.view) == {("b", 2)}
    await add_endpoint(discovery, "b", 3)
    await wait_for(lambda: endpoints_of(watch.view) == {("b", 2), ("b", 3)})
    assert watch.view.namespaces == {"b"} and len(feed.opened) == 1
    assert watch.status.count == 2  # watch-all: the namespaces seen in discovery, a and b


@pytest.mark.parametrize(
    ("kwargs", "rule"),
    [
        ({"namespaces": ["a"], "watch_all": True}, "not both"),
        ({}, "`namespaces` (a list) or `watch_all`"),
        ({"namespaces": ["a"], "endpoint_prefixes": ["b.c"]}, "inside a listed namespace"),
        ({"watch_all": True, "endpoint_prefixes": ["a.b.c.d"]}, "ns.component.endpoint"),
        ({"namespaces": ["a b"]}, "invalid namespace"),
        ({"namespaces": ["abc\n"]}, "invalid namespace"),  # (`$` let a trailing newline by)
        ({"watch_all": True, "endpoint_prefixes": ["a.b.c\n"]}, "invalid endpoint"),
    ],
)
def test_a_discovery_source_breaking_a_rule_is_refused_naming_it(
    kwargs: dict[str, object], rule: str
) -> None:
    with pytest.raises(ConfigError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        DiscoverySource(**kwargs)  # type: ignore[arg-type]


async def test_first_setup_is_bounded_and_says_why_it_failed(discovery: Discovery) -> None:
    source = DrivenSource()
    source.push(SourceError("sources file /x: not found"))
    watch = MembershipWatch(discovery, source, setup_timeout=0.3)
    with pytest.raises(MembershipError, match=re.escape("not set up within 0.3s: sources file /x")):
        await watch.start()


async def test_a_watch_that_ends_is_reopened_with_a_new_epoch(
    start_watch: StartWatch, discovery: Discovery, feed: CountingFeed
) -> None:
    opened: list[ScopeWatch] = []

    class KeepingFeed(CountingFeed):
        async def open(self, query: Query, revision: int | None = None) -> ScopeWatch:
            opened.append(await super().open(query, revision))
            return opened[-1]

    source = DrivenSource()
    source.push(Selection.of(["a"]))
    watch = await start_watch(source, feed=KeepingFeed(discovery), retry_tick=0.05)
    epoch = watch.epochs()["a"]
    await opened[0].close()
    opened[0]._queue.put_nowait(None)  # the stream ends, as after a lost server
    await wait_for(lambda: watch.epochs()["a"] > epoch)
    await add_endpoint(discovery, "a", 7)
    await wait_for(lambda: endpoints_of(watch.view) == {("a", 7)})
    assert watch.status.last_error is None


async def test_a_failure_is_logged_once_per_distinct_error_not_per_tick(
    start_watch: StartWatch, discovery: Discovery, caplog: pytest.LogCaptureFixture
) -> None:
    source = DrivenSource()
    source.push(Selection.of(["a"]))
    watch = await start_watch(source, retry_tick=0.01)
    for message in ("bad: one", "bad: one", "bad: one", "bad: two"):
        source.push(SourceError(message))
    await wait_for(lambda: watch.status.last_error == "bad: two")
    logged = [r.getMessage() for r in caplog.records if "bad:" in r.getMessage()]
    assert len(logged) == 2 and "bad: one" in logged[0] and "bad: two" in logged[1]


async def test_a_source_that_closes_is_reported_and_its_selection_stays(
    start_watch: StartWatch, discovery: Discovery
) -> None:
    await add_endpoint(discovery, "a", 1)
    selected = Selection.of(["a"])

    class OneShot:
        async def selections(self) -> AsyncIterator[Selection | SourceError]:
            yield selected  # then the source ends

    watch = await start_watch(OneShot(), retry_tick=0.05)
    await wait_for(lambda: watch.status.last_error)
    assert "namespace source closed" in (watch.status.last_error or "")
    assert watch.status.applied_revision == selected.revision
    assert endpoints_of(watch.view) == {("a", 1)}


async def test_an_update_that_cannot_be_set_up_in_time_keeps_the_old_selection(
    start_watch: StartWatch, discovery: Discovery, feed: CountingFeed
) -> None:
    await add_endpoint(discovery, "a", 1)
    await add_endpoint(discovery, "b", 2)
    hung = asyncio.Event()

    class HangingFeed(CountingFeed):
        async def open(self, query: Query, revision: int | None = None) -> ScopeWatch:
            if query.namespace == "b":
                await hung.wait()  # a store call that never answers
            return await super().open(query, revision)

    source = DrivenSource()
    first = Selection.of(["a"])
    source.push(first)
    watch = await start_watch(source, feed=HangingFeed(discovery), update_timeout=0.3)
    second = Selection.of(["b"])
    source.push(second)
    await wait_for(lambda: watch.status.last_error, timeout=5)
    assert f"selection {second.revision} not in force" in (watch.status.last_error or "")
    assert "not done within 0.3s" in (watch.status.last_error or "")
    assert watch.status.applied_revision == first.revision
    assert watch.status.desired_revision == second.revision
    assert endpoints_of(watch.view) == {("a", 1)}
    hung.set()  # the store answers again: the next attempt puts it in force
    await wait_for(lambda: watch.status.applied_revision == second.revision)
    assert endpoints_of(watch.view) == {("b", 2)} and watch.status.last_error is None


async def test_a_namespace_moving_under_watch_all_leaves_every_other_namespaces_scope_as_is(
    start_watch: StartWatch, discovery: Discovery
) -> None:
    """Every namespace's scope was made again (sorted, a `Query` each) when one joined or left:
    30-40 ms at 10,000 namespaces, in one callback, and every consumer compared them all. Now
    only the namespaces that moved are made; the others keep their very queries."""
    keys = [await add_endpoint(discovery, f"ns{i:03d}", i + 1) for i in range(40)]
    watch = await start_watch(DiscoverySource(watch_all=True))
    before = watch.view.scopes
    assert len(before) == 40
    await add_endpoint(discovery, "joined", 99)
    await wait_for(lambda: "joined" in watch.view.scopes)
    await remove_endpoint(discovery, keys[7])
    await wait_for(lambda: "ns007" not in watch.view.scopes)
    after = watch.view.scopes
    assert set(after) == set(before) - {"ns007"} | {"joined"}
    assert all(after[ns] is before[ns] for ns in after if ns != "joined")
