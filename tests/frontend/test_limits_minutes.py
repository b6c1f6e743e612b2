"""tpm reservations given back to the minute they were made in, not the one a request ends
in: the local windows on an injected clock, and Redis (`LEASE`) told each reservation's
window. And a refusal's `x-ratelimit-reset-*`: each limit its own."""

from __future__ import annotations

import re
import types

import pytest
import redis.asyncio

from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend.keys import limits, windows
from shoal.frontend.keys.limits import Limits
from shoal.frontend.keys.windows import LocalWindows, Refusal
from tests.frontend.test_limits_faults import Told, redis_server, shared, tokens_of
from tests.helpers import wait_for
from tests.redis_server import RedisServer

__all__ = ["redis_server", "shared"]  # the fixtures

KEY = Grant(workspace="w", name="k", hash=hash_secret("sk-shoal-" + "d" * 43), tpm=100_000)
LONG = b'{"model":"m","prompt":"hi","max_tokens":50000}'  # reserves its estimate, ~50,000


class Ticket:
    reserved, shared, minute = 0, False, -1


def test_a_request_ending_minutes_later_gives_its_reservation_back_to_its_own_minute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A admitted in minute 0 reserves ~50,000; B admitted in minute 2 uses 30,000; A ends in
    minute 2 having used 20,000: minute 2 holds both answers (A's reservation left the
    sliding window with minute 0). Through `Limits` (no Redis) on an injected clock."""
    clock = [0.0]
    monkeypatch.setattr(windows, "time", types.SimpleNamespace(time=lambda: clock[0]))
    made = Limits()
    a, b = Ticket(), Ticket()
    assert isinstance(made.admit(KEY, tokens_of(LONG), a), bytes)
    assert (a.reserved, a.minute) == (len(LONG) // 4 + 50_000, 0)
    clock[0] = 150.0
    assert isinstance(made.admit(KEY, tokens_of(b'{"model":"m"}'), b), bytes)
    made.charge(KEY, 30_000, b.reserved, b.shared, b.minute)
    clock[0] = 151.0
    made.charge(KEY, 20_000, a.reserved, a.shared, a.minute)
    window = made.local._windows["w"]["k"]
    assert (window.minute, window.tokens, window.prev_tokens) == (2, 50_000, 0)


def test_a_reservation_of_the_previous_minute_is_given_back_there() -> None:
    local = LocalWindows()
    other, a = Ticket(), Ticket()
    assert isinstance(local.admit(KEY, 1, tokens_of(LONG), a, now=50.0), bytes)  # minute 0
    assert isinstance(local.admit(KEY, 1, 0, other, now=55.0), bytes)
    local.charge(KEY, 10_000, other.reserved, now=55.0, minute=other.minute)
    local.charge(KEY, 20_000, a.reserved, now=70.0, minute=a.minute)  # ends in minute 1
    window = local._at(KEY, 1)
    assert (window.prev_tokens, window.tokens) == (10_000, 20_000)
    # the same minute: what the answer used beyond (or short of) its reservation, as ever
    same = Ticket()
    assert isinstance(local.admit(KEY, 1, 0, same, now=71.0), bytes)
    local.charge(KEY, 5, same.reserved, now=80.0, minute=same.minute)
    assert (window.prev_tokens, window.tokens) == (10_000, 20_005)


def test_a_local_refusal_tells_each_limit_its_own_reset() -> None:
    local = LocalWindows()
    key = Grant(workspace="w", name="k", hash=KEY.hash, rpm=100, tpm=10)
    now = 600.0 + 15  # a quarter into the minute: it turns in 45 s
    assert isinstance(local.admit(key, 1, 0, Ticket(), now=now), bytes)
    local.charge(key, 100, now=now)  # tpm spent ten times over
    refused = local.admit(key, 1, 0, Ticket(), now=now)
    assert isinstance(refused, Refusal) and refused.what == "tokens"
    assert refused.retry_after > 60
    assert b"x-ratelimit-reset-requests: 45s\r\n" in refused.headers
    assert b"x-ratelimit-reset-tokens: %ds\r\n" % refused.retry_after in refused.headers
    key = Grant(workspace="w", name="k2", hash=KEY.hash, rpm=1, tpm=10_000)
    assert isinstance(local.admit(key, 1, 0, Ticket(), now=now), bytes)
    refused = local.admit(key, 1, 0, Ticket(), now=now)
    assert isinstance(refused, Refusal) and refused.what == "requests"
    assert b"x-ratelimit-reset-requests: %ds\r\n" % refused.retry_after in refused.headers
    assert b"x-ratelimit-reset-tokens: 45s\r\n" in refused.headers


async def _tokens(redis_server: RedisServer, key: Grant, window: int) -> int:
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        return int(await client.get(f"shoal:rl:{limits._redis_id(key)}:t:{window}") or 0)
    finally:
        await client.aclose()


async def _set(redis_server: RedisServer, key: Grant, window: int, tokens: int) -> None:
    """The tokens Redis holds for `key` in `window`."""
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await client.set(f"shoal:rl:{limits._redis_id(key)}:t:{window}", tokens)
    finally:
        await client.aclose()


async def test_redis_is_given_each_reservation_back_in_its_own_window(
    shared: Limits, redis_server: RedisServer
) -> None:
    """In Redis, B admitted now (window w) holds its reservation; A, admitted two minutes ago
    (its 50,000 long gone), ends with 20,000; C, admitted in w - 1 (its 50,000 there), ends
    with 7,000: w holds B's reservation and both answers, w - 1 nothing. Were Redis' minute
    to turn meanwhile (the test takes milliseconds), it is run again."""
    for attempt in range(3):
        key = Grant(workspace="w", name=f"k{attempt}", hash=KEY.hash, tpm=1_000_000)
        b = Told()
        b.tokens = tokens_of(b'{"model":"m","prompt":"hi"}')
        shared.wait(key, b)
        await wait_for(lambda b=b: b.verdicts)  # type: ignore[misc]
        assert isinstance(b.verdicts[0], bytes) and b.shared
        w = b.minute
        assert await _tokens(redis_server, key, w) == b.reserved
        await _set(redis_server, key, w - 1, 50_000)  # C's reservation
        shared.charge(key, 20_000, 50_000, True, w - 2)  # A
        shared.charge(key, 7_000, 50_000, True, w - 1)  # C
        await shared._flush(final=True)
        now = await shared.link.call("TIME")  # type: ignore[union-attr]
        if int(now[0]) // windows.WINDOW != w:
            continue  # the minute turned: again, on a key of its own
        assert await _tokens(redis_server, key, w) == b.reserved + 27_000
        assert await _tokens(redis_server, key, w - 1) == 0
        assert await _tokens(redis_server, key, w - 2) == 0  # (not made again, at 0 or less)
        return
    pytest.fail("Redis' minute turned during each attempt")


async def test_a_redis_refusal_tells_each_limit_its_own_reset(
    shared: Limits, redis_server: RedisServer
) -> None:
    key = Grant(workspace="w", name="k", hash=KEY.hash, rpm=1000, tpm=10)
    first = Told()
    shared.wait(key, first)
    await wait_for(lambda: first.verdicts)
    for window in (first.minute, first.minute + 1):  # (were the minute to turn meanwhile)
        await _set(redis_server, key, window, 10**9)  # tpm spent many times over
    second = Told()
    shared.wait(key, second)
    await wait_for(lambda: second.verdicts)
    refused = second.verdicts[0]
    assert isinstance(refused, Refusal) and refused.what == "tokens"
    found = dict(re.findall(rb"x-ratelimit-reset-(\w+): (\d+)s", refused.headers))
    assert int(found[b"tokens"]) == refused.retry_after
    assert int(found[b"requests"]) <= 60 < refused.retry_after  # the minute's turn
