"""Two selections quickly one after the other: the last one wins, and one that was replaced
before it was set up never goes into force (its namespaces never join the view, those it
dropped never leave it). A real sources file rewritten while a swap is being set up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shoal.discovery import Discovery, Query
from shoal.membership import DiscoveryFeed, FileSource, Membership, MembershipWatch
from shoal.membership.feed import ScopeWatch
from tests.helpers import wait_for
from tests.membership.support import CountingFeed, add_endpoint
from tests.membership.test_frontend import write_sources


@pytest.mark.parametrize("answered", ["after-the-fix", "with-the-fix"])
async def test_a_selection_replaced_while_it_is_set_up_never_goes_into_force(
    discovery: Discovery, tmp_path: Path, answered: str
) -> None:
    """The swap went into force once its watches opened, after the rewrite that replaced it
    (its namespaces joined, `a` left, then the other way round), or, while they did not
    open, held the last rewrite back until `update_timeout`."""
    for namespace, ident in [("a", 1), ("b", 2), ("c", 3)]:
        await add_endpoint(discovery, namespace, ident)
    store_answers = asyncio.Event()

    class SlowFeed(CountingFeed):
        async def open(self, query: Query, revision: int | None = None) -> ScopeWatch:
            if query.namespace == "b":
                await store_answers.wait()  # the store is slow to open b's watch
            return await super().open(query, revision)

    path = tmp_path / "sources.json"
    first = write_sources(path, "a")
    source = FileSource(path, poll_interval=0.2)
    watch = MembershipWatch(discovery, source, feed=SlowFeed(discovery), update_timeout=30)
    views: list[Membership] = []
    watch.subscribe(views.append)
    await watch.start()
    try:
        assert watch.status.applied_revision == first
        swap = write_sources(path, "b")  # a swap: a leaves, once b is set up
        await wait_for(lambda: watch.status.desired_revision == swap, message="b desired")
        fixed = write_sources(path, "a", "c")  # the operator's next rewrite, mid-swap
        await wait_for(lambda: watch.status.desired_revision == fixed, message="a+c desired")
        if answered == "with-the-fix":
            store_answers.set()
        # The last rewrite is put in force without waiting for the one it replaced.
        await wait_for(lambda: watch.status.applied_revision == fixed, timeout=5)
        store_answers.set()  # b's watch would open now: too late, nothing asks for it
        await wait_for(lambda: watch.view.namespaces == {"a", "c"})
        assert all(view.revision != swap for view in views), [v.revision for v in views]
        assert all("a" in view.namespaces for view in views)  # a never left
        assert watch.status.to_dict() == {
            "desired_revision": fixed,
            "applied_revision": fixed,
            "count": 2,
            "last_error": None,
        }
    finally:
        store_answers.set()
        await watch.stop()


async def test_a_source_error_then_the_same_selection_again_does_not_restart_its_set_up(
    discovery: Discovery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sources file caught half-written (an error), then whole again, mid-swap: the same
    selection comes back, nothing newer. Its set-up was abandoned as if replaced: the watch
    being opened was cancelled and opened anew, and the swap reported not in force for being
    "not done within" an `update_timeout` (30 s) it never reached."""
    for namespace, ident in [("a", 1), ("b", 2)]:
        await add_endpoint(discovery, namespace, ident)
    store_answers = asyncio.Event()

    class SlowFeed(CountingFeed):
        async def open(self, query: Query, revision: int | None = None) -> ScopeWatch:
            self.opened.append(query)
            if query.namespace == "b":
                await store_answers.wait()  # the store is slow to open b's watch
            return await DiscoveryFeed.open(self, query, revision)

    path, feed = tmp_path / "sources.json", SlowFeed(discovery)
    write_sources(path, "a")
    watch = MembershipWatch(
        discovery, FileSource(path, poll_interval=0.2), feed=feed, update_timeout=30
    )
    await watch.start()
    try:
        swap = write_sources(path, "b")
        await wait_for(lambda: Query(namespace="b") in feed.opened, message="b opening")
        path.write_text('{"version": 1, "sources": [{"namesp')  # caught half-written
        await wait_for(lambda: watch.status.desired_revision is None, message="the error")
        assert write_sources(path, "b") == swap  # whole again: the same selection
        await wait_for(lambda: watch.status.desired_revision == swap)
        store_answers.set()
        await wait_for(lambda: watch.status.applied_revision == swap, timeout=5)
        assert feed.opened.count(Query(namespace="b")) == 1, "b's watch opened again"
        said = [r.getMessage() for r in caplog.records]
        assert not [m for m in said if "not in force" in m], said
        assert watch.status.last_error is None
    finally:
        store_answers.set()
        await watch.stop()
