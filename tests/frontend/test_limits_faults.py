"""API keys' limits under faults, on a real Redis (`tests/redis_server.py`), `Limits` alone:
many keys owing tokens at once, Redis losing its scripts or its data, Redis hanging."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio

from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend.keys import limits, redis_link, windows
from shoal.frontend.keys.limits import Limits
from shoal.frontend.keys.redis_link import RedisLink
from shoal.frontend.proxy.fields import decode_fields
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


def tokens_of(body: bytes) -> int:
    """A request's `windows.estimate`, as the request path makes it of its body."""
    fields = decode_fields(body, with_tokens=True)
    return windows.estimate(len(body), fields.max_completion_tokens, fields.max_tokens)


class Told:
    """A request waiting for Redis' answer (`limits.Waiter`): what it was told."""

    def __init__(self) -> None:
        self.cancelled = False
        self.verdicts: list[object] = []
        self.tokens = 0  # its estimate
        self.ticket = self
        self.reserved = 0  # tokens reserved for it when admitted
        self.shared = False
        self.minute = 0

    def admitted(self, headers: bytes) -> None:
        self.verdicts.append(headers)

    def refused(self, refusal: windows.Refusal) -> None:
        self.verdicts.append(refusal)


async def test_scripts_flushed_in_redis_are_sent_again_and_the_limits_stay_shared(
    shared: Limits, redis_server: RedisServer
) -> None:
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await client.script_flush()
        await client.flushall()
    finally:
        await client.aclose()
    waiters = [Told() for _ in range(3)]
    for i, waiter in enumerate(waiters):
        shared.wait(grant(i, rpm=1), waiter)
    await wait_for(lambda: all(w.verdicts for w in waiters))
    assert all(w.verdicts == [w.verdicts[0]] and isinstance(w.verdicts[0], bytes)
               for w in waiters)  # fmt: skip
    assert shared.shared
    second = Told()
    shared.wait(grant(0, rpm=1), second)  # counted in Redis: the second of rpm 1 is refused
    await wait_for(lambda: second.verdicts)
    assert isinstance(second.verdicts[0], windows.Refusal)


async def test_a_link_sends_many_calls_in_bounded_batches(redis_server: RedisServer) -> None:
    link = RedisLink(redis_server.url, 2.0)
    try:
        answers = await asyncio.gather(*(link.call("INCR", "n") for _ in range(1000)))
    finally:
        await link.close()
    assert answers == list(range(1, 1001))  # in order, every one
    # one write (and one loop turn reading the answers) per batch: the loop is not held long
    assert link.round_trips >= 1000 / redis_link.MAX_BATCH


async def test_scripts_redis_lost_are_loaded_once_not_sent_whole_with_each_call(
    redis_server: RedisServer,
) -> None:
    link = RedisLink(redis_server.url, 2.0)
    sha = link.script("return tonumber(ARGV[1]) + 1")
    try:
        answers = await asyncio.gather(*(link.call("EVALSHA", sha, 0, i) for i in range(100)))
        assert answers == [i + 1 for i in range(100)]
        stats = await link.call("INFO", "commandstats")
    finally:
        await link.close()
    stats = stats.decode() if isinstance(stats, bytes) else stats
    assert "cmdstat_eval:" not in stats  # the script went once, not 100 times
    assert "cmdstat_script|load:calls=1," in stats


async def test_redis_hanging_answers_every_waiting_request_from_the_fallback_then_resumes(
    shared: Limits, redis_server: RedisServer
) -> None:
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)  # Redis hangs (a 5 s pause)
    try:
        waiters = [Told() for _ in range(200)]
        for i, waiter in enumerate(waiters):
            shared.wait(grant(i % 50, rpm=1000), waiter)
        # every one told by the fallback once Redis' answer is overdue (`limits.TIMEOUT`)
        await wait_for(lambda: all(w.verdicts for w in waiters), timeout=3)
        assert all(isinstance(w.verdicts[0], bytes) for w in waiters)
        assert not shared.shared and shared.describe()["state"] == "fallback"
        assert shared.admit(grant(0, rpm=1000)) is not None  # decided here meanwhile
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    await wait_for(lambda: shared.shared, timeout=5)
    after = Told()
    shared.wait(grant(99, rpm=1), after)
    await wait_for(lambda: after.verdicts)
    again = Told()
    shared.wait(grant(99, rpm=1), again)  # Redis counts again: the second of rpm 1 refused
    await wait_for(lambda: again.verdicts)
    assert isinstance(again.verdicts[0], windows.Refusal)


async def test_a_lowered_limit_takes_effect_at_once_on_a_key_holding_an_allowance(
    shared: Limits,
) -> None:
    generous = grant(0, rpm=1_000_000)
    for _ in range(3):  # the key is busy: its next lease brings an allowance
        told = Told()
        shared.wait(generous, told)
        await wait_for(lambda told=told: told.verdicts)
    assert isinstance(shared.admit(generous), bytes)  # on the allowance, no round trip
    lowered = grant(0, rpm=2)  # the store's new version of the key
    assert shared.admit(lowered) is None  # the allowance is not the new limit's: Redis decides
    told = Told()
    shared.wait(lowered, told)
    await wait_for(lambda: told.verdicts)
    assert isinstance(told.verdicts[0], windows.Refusal) and told.verdicts[0].what == "requests"


def test_the_state_of_many_keys_is_small() -> None:
    """`limits.MAX_KEYS` keys' states are held at most: each costs a few hundred bytes, not
    a queue of waiting requests it has not got (a deque is 760 bytes empty)."""
    import tracemalloc

    grants = [grant(i, rpm=100, tpm=1000) for i in range(10_000)]
    limits_here = Limits("redis://127.0.0.1:1")  # (never started: only the states)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for made in grants:
            limits_here._key(made)
            limits_here.charge(made, 10)
        per_key = (tracemalloc.get_traced_memory()[0] - before) / len(grants)
    finally:
        tracemalloc.stop()
    assert per_key < 400, f"{per_key:.0f} bytes a key"  # (~350; 1,050 with a deque)


async def test_an_outage_seeds_a_key_with_what_it_used_under_the_limits_redis_counted_for(
    shared: Limits, redis_server: RedisServer
) -> None:
    # rpm 30, 24 used (6 left), then the key's rpm raised to 300 and Redis gone: the local
    # windows start at the 24 used, so 276 more are admitted this minute, not 6 (300 - 6
    # taken for used); and lowered to 10, none (the 24 are past it)
    for _ in range(24):
        told = Told()
        shared.wait(grant(0, rpm=30), told)
        await wait_for(lambda told=told: told.verdicts)
        assert isinstance(told.verdicts[0], bytes)
    used = 30 - shared._keys["default"]["k0"].left_requests  # (24, and any allowance left)
    raised, lowered = grant(0, rpm=300), grant(1, rpm=10)
    for _ in range(12):
        told = Told()
        shared.wait(grant(1, rpm=30), told)
        await wait_for(lambda told=told: told.verdicts)
    redis_server.stop()
    await wait_for(lambda: not shared.shared, timeout=5)
    local_minute = int(time.time() // windows.WINDOW)
    admitted = 0
    while isinstance(shared.admit(raised), bytes) and admitted < 400:
        admitted += 1
    if int(time.time() // windows.WINDOW) == local_minute:  # (not across a minute's turn)
        assert admitted == 300 - used, (admitted, used)
        assert isinstance(shared.admit(lowered), windows.Refusal)
