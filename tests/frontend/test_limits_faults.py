"""API keys' limits under faults, on a real Redis (`tests/redis_server.py`), `Limits` alone:
many keys owing tokens at once, Redis losing its scripts or its data, Redis hanging."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio

from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend.keys import limits
from shoal.frontend.keys.limits import Limits
from tests.helpers import wait_for
from tests.redis_server import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
async def shared(redis_server: RedisServer) -> AsyncIterator[Limits]:
    made = Limits(redis_server.url)
    await made.start()
    await wait_for(lambda: made.shared)
    try:
        yield made
    finally:
        await made.stop()


def grant(i: int, **limits: int) -> Grant:
    return Grant(workspace="default", name=f"k{i}", hash=hash_secret(f"sk-shoal-{i:043d}"),
                 **limits)  # fmt: skip


async def tokens_in_redis(redis_server: RedisServer) -> int:
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        keys = await client.keys("shoal:rl:*:t:*")
        return sum(int(v) for v in await client.mget(keys)) if keys else 0
    finally:
        await client.aclose()


async def test_tokens_owed_by_more_keys_than_one_flush_settles_all_reach_redis(
    shared: Limits, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "FLUSH_BATCH", 2)  # 5 keys owe: three flushes settle them
    for i in range(5):
        shared.charge(grant(i, tpm=10_000), 4)

    async def all_charged() -> bool:
        return await tokens_in_redis(redis_server) == 20

    await wait_for(all_charged, timeout=5)
