"""Fixtures for the membership tests: an in-memory discovery, and watches stopped at the end."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from shoal.discovery import Discovery
from shoal.membership import MembershipWatch, Source
from shoal.store import open_store
from tests.membership.support import CountingFeed

StartWatch = Callable[..., Awaitable[MembershipWatch]]


@pytest.fixture
async def discovery() -> AsyncIterator[Discovery]:
    store = await open_store(f"memory://{uuid.uuid4().hex}")
    yield Discovery(store)
    await store.close()


@pytest.fixture
def feed(discovery: Discovery) -> CountingFeed:
    return CountingFeed(discovery)


@pytest.fixture
async def start_watch(discovery: Discovery, feed: CountingFeed) -> AsyncIterator[StartWatch]:
    started: list[MembershipWatch] = []

    async def start(source: Source, **kwargs: Any) -> MembershipWatch:
        kwargs.setdefault("feed", feed)
        watch = MembershipWatch(discovery, source, **kwargs)
        started.append(watch)
        await watch.start()
        return watch

    yield start
    for watch in started:
        await watch.stop()
