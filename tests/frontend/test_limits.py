"""API keys' limits across frontends, on a real Redis (`tests/redis_server.py`): rpm and tpm
shared by three frontends, 429s with the headers clients read, Redis killed and back."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import struct
import time
from collections.abc import Awaitable, Iterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio

from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend import Frontend
from shoal.frontend.keys import limits
from shoal.frontend.keys.limits import Limits
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.test_limits_faults import Told, shared, tokens_of
from tests.helpers import wait_for
from tests.redis_server import RedisServer

SECRET = "sk-shoal-" + "c" * 43
BODY = json.dumps({"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]})

__all__ = ["shared"]  # the fixture


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


async def grant(store: Store, **limits: Any) -> None:
    made = Grant(workspace="default", name="team", hash=hash_secret(SECRET), **limits)
    await store.put(made.key, made.to_json())


async def post(session: aiohttp.ClientSession, frontend: Frontend) -> tuple[int, Any]:
    async with session.post(
        f"{frontend.url}/v1/chat/completions",
        data=BODY,
        headers={"authorization": f"Bearer {SECRET}", "content-type": "application/json"},
    ) as response:
        await response.read()
        return response.status, response.headers


async def health(frontend: Frontend) -> dict[str, Any]:
    return frontend.health()[1]["limits"]  # type: ignore[no-any-return]


async def three(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend, url: str, **limits: Any
) -> list[Frontend]:
    await start_worker("mock-llm")
    await grant(store, **limits)
    fronts = [await start_frontend(auth="keys", limits_url=url) for _ in range(3)]
    await wait_for(lambda: all("mock-llm" in f.registry.models and f.keys and f.keys.by_hash
                               for f in fronts))  # fmt: skip
    await wait_for(lambda: all(f.limits.shared and f.limits.frontends == 3 for f in fronts))
    return fronts


async def test_rpm_is_shared_by_three_frontends_and_429s_say_when_to_retry(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer,
) -> None:  # fmt: skip
    fronts = await three(store, start_worker, start_frontend, redis_server.url, rpm=10)
    statuses: list[int] = []
    async with aiohttp.ClientSession() as session:
        for i in range(30):  # round-robin over the three
            status, headers = await post(session, fronts[i % 3])
            statuses.append(status)
            assert headers["x-ratelimit-limit-requests"] == "10"
            if status == 429:
                assert int(headers["retry-after"]) >= 1
                assert headers["x-ratelimit-remaining-requests"] == "0"
                assert headers["x-ratelimit-reset-requests"].endswith("s")
    # shared: 10 in all (local windows at 1/3 each would let 12 through, alone 30)
    assert abs(statuses.count(200) - 10) <= 1, statuses
    assert statuses.count(429) + statuses.count(200) == 30


async def test_tpm_charges_the_tokens_of_each_answer_after_the_fact(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer,
) -> None:  # fmt: skip
    fronts = await three(store, start_worker, start_frontend, redis_server.url, tpm=20)
    statuses: list[int] = []
    async with aiohttp.ClientSession() as session:
        for i in range(15):  # each answer uses 4 tokens (1 prompt + 3 completion)
            status, headers = await post(session, fronts[i % 3])
            statuses.append(status)
            if status == 429:
                assert headers["x-ratelimit-remaining-tokens"] == "0" and headers["retry-after"]
    assert 5 <= statuses.count(200) <= 6, statuses


async def test_redis_down_fails_open_onto_local_limits_and_shared_limits_resume(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer,
) -> None:  # fmt: skip
    fronts = await three(store, start_worker, start_frontend, redis_server.url, rpm=30)
    async with aiohttp.ClientSession() as session:
        assert [(await post(session, f))[0] for f in fronts] == [200, 200, 200]
        redis_server.stop()
        # requests keep flowing: the first one to find Redis gone is admitted locally
        assert [(await post(session, f))[0] for f in fronts] == [200, 200, 200]
        await wait_for(lambda: all(not f.limits.shared for f in fronts), timeout=5)
        for front in fronts:
            described = await health(front)
            assert described["state"] == "fallback" and "1/3" in described["reason"]
            answered = [(await post(session, front))[0] for _ in range(15)]
            # 30 / 3 here, less the third of the 3 counted before Redis went, this one included
            assert answered.count(200) in (8, 9), answered

        redis_server.start()
        await wait_for(lambda: all(f.limits.shared for f in fronts), timeout=5)
        assert (await health(fronts[0]))["state"] == "shared"
        answered = [(await post(session, fronts[0]))[0] for _ in range(40)]
        assert abs(answered.count(200) - 30) <= 1, answered  # one frontend, the whole limit
        assert (await post(session, fronts[1]))[0] == 429  # and it is shared


async def test_an_outage_does_not_give_a_key_its_used_minute_again(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer,
) -> None:  # fmt: skip
    # rpm 30 over three frontends, 24 used before Redis goes: the local windows start at each
    # frontend's third of those 24, so the minute lets about 6 more through, not 30
    fronts = await three(store, start_worker, start_frontend, redis_server.url, rpm=30)
    async with aiohttp.ClientSession() as session:
        assert [(await post(session, fronts[i % 3]))[0] for i in range(24)] == [200] * 24
        redis_server.stop()
        answered = [(await post(session, f))[0] for f in fronts for _ in range(15)]
        await wait_for(lambda: all(not f.limits.shared for f in fronts), timeout=5)
        answered += [(await post(session, f))[0] for f in fronts for _ in range(15)]
    assert 6 <= answered.count(200) <= 9, answered  # started empty: 30
    assert answered.count(200) + answered.count(429) == len(answered)


async def counted(redis_server: RedisServer, kind: str) -> int:
    """What Redis holds for the test's key: requests ("r") or tokens ("t"), both windows."""
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        keys = await client.keys(f"shoal:rl:*:{kind}:*")  # (the test's one key)
        return sum(int(v) for v in await client.mget(keys)) if keys else 0
    finally:
        await client.aclose()


async def one(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend, url: str, **limits: Any
) -> Frontend:
    await start_worker("mock-llm")
    await grant(store, **limits)
    front = await start_frontend(auth="keys", limits_url=url)
    await wait_for(
        lambda: "mock-llm" in front.registry.models and front.keys and front.keys.by_hash
    )
    await wait_for(lambda: front.limits.shared)
    return front


async def test_a_request_costs_one_round_trip_and_its_tokens_ride_on_the_next(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(limits, "FLUSH", 3600.0)  # no flush: only requests reach Redis
    # rpm 20 is too small for an allowance (< LEASE_SHARE): Redis decides each request
    front = await one(store, start_worker, start_frontend, redis_server.url, rpm=20, tpm=10_000)
    async with aiohttp.ClientSession() as session:
        for _ in range(10):
            assert (await post(session, front))[0] == 200
    assert (front.limits.leases, front.limits.settles) == (10, 0)  # no round trip to charge
    # each request reserves its own estimate (19: larger than the key's 4 per answer); its
    # answer's 4 tokens, its reservation given back, ride on the next request's LEASE: 9
    # answers settled, the last one's reservation still held
    assert await counted(redis_server, "t") == 9 * 4 + len(BODY) // 4
    assert await counted(redis_server, "r") == 10


async def test_tokens_an_idle_key_owes_reach_redis_without_a_request(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer,
) -> None:  # fmt: skip
    front = await one(store, start_worker, start_frontend, redis_server.url, tpm=10_000)
    async with aiohttp.ClientSession() as session:
        assert (await post(session, front))[0] == 200
    # reserved when admitted (its estimate: no answer yet), then settled to the answer's 4 by
    # the flush, every 0.25 s
    await wait_for(lambda: _equals(counted(redis_server, "t"), 4), timeout=2)
    assert front.limits.leases == 1


async def test_a_busy_key_leases_allowances_and_redis_counts_only_what_was_admitted(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer,
) -> None:  # fmt: skip
    front = await one(store, start_worker, start_frontend, redis_server.url, rpm=1_000_000)
    async with aiohttp.ClientSession() as session:

        async def hammer() -> list[int]:
            return [(await post(session, front))[0] for _ in range(20)]

        answered = [
            s for part in await asyncio.gather(*(hammer() for _ in range(15))) for s in part
        ]
    assert answered == [200] * 300
    assert front.limits.leases < 300 / 4, front.limits.leases  # allowances, not a trip each
    # what was leased and not used goes back once the allowance's time is over
    await wait_for(lambda: _equals(counted(redis_server, "r"), 300), timeout=5)


async def _equals(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def test_allowances_never_admit_more_than_rpm_across_three_frontends(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer,
) -> None:  # fmt: skip
    rpm = 3 * limits.LEASE_SHARE * 4  # an allowance of up to 4 requests per frontend
    fronts = await three(store, start_worker, start_frontend, redis_server.url, rpm=rpm)
    # not across a minute's turn: the previous minute's count then starts to fade
    await wait_for(lambda: time.time() % 60 < 45, timeout=20)
    async with aiohttp.ClientSession() as session:

        async def hammer(front: Frontend) -> list[int]:
            return [(await post(session, front))[0] for _ in range(25)]

        parts = await asyncio.gather(*(hammer(f) for f in fronts for _ in range(6)))
    answered = [s for part in parts for s in part]
    assert set(answered) == {200, 429}
    # never over the limit; under it by what allowances held at most (1/LEASE_SHARE)
    assert rpm - rpm // limits.LEASE_SHARE <= answered.count(200) <= rpm, answered.count(200)
    assert sum(f.limits.leases for f in fronts) < answered.count(200) / 2


async def test_a_client_that_leaves_while_redis_answers_is_never_forwarded(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer,
) -> None:  # fmt: skip
    worker = await start_worker("mock-llm")
    await grant(store, rpm=20, max_parallel=1)  # Redis decides each request
    front = await start_frontend(auth="keys", limits_url=redis_server.url)
    await wait_for(
        lambda: "mock-llm" in front.registry.models and front.keys and front.keys.by_hash
    )
    await wait_for(lambda: front.limits.shared)
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)  # Redis hangs: the request waits
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
            b"content-length: %d\r\n\r\n%s" % (SECRET.encode(), len(BODY), BODY.encode())
        )
        await wait_for(lambda: front.limits.in_flight)  # it waits for Redis
        sock = writer.get_extra_info("socket")  # the client leaves: a reset (after a mere
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # half-close, the server still answers)
        await wait_for(lambda: not front.limits.in_flight)  # its place is given back at once
        await wait_for(lambda: not front.limits.shared, timeout=5)  # Redis' answer timed out
        assert worker.requests == 0  # and the request never went on
        async with aiohttp.ClientSession() as session:
            assert (await post(session, front))[0] == 200  # the fallback's local windows
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert worker.requests == 1


def test_local_windows_reserve_the_tokens_of_requests_in_flight() -> None:
    """Without Redis (or while it is down) a request admitted reserves its tokens at once: a
    burst in flight cannot pass tpm by more than its last request; its end charges what its
    answer used instead of the reservation."""
    from shoal.frontend.keys.windows import LocalWindows, Refusal

    class Ticket:
        reserved, shared = 0, False

    key = Grant(workspace="default", name="team", hash=hash_secret(SECRET), tpm=20)
    local, now = LocalWindows(), 600.0  # the start of a minute: nothing fades
    assert tokens_of(BODY.encode()) == len(BODY) // 4
    first = Ticket()
    assert isinstance(local.admit(key, 1, tokens_of(BODY.encode()), first, now=now), bytes)
    assert first.reserved == len(BODY) // 4  # no answer yet: the request's estimate
    local.charge(key, 4, first.reserved, now=now)  # the answer used 4 tokens
    burst = [Ticket() for _ in range(40)]
    verdicts = [local.admit(key, 1, tokens_of(BODY.encode()), ticket, now=now) for ticket in burst]
    admitted = [t for t, v in zip(burst, verdicts, strict=True) if isinstance(v, bytes)]
    per = len(BODY) // 4  # each its own estimate still: larger than the key's 4 per answer
    assert all(t.reserved == per for t in admitted)
    assert 4 + per * len(admitted) - per < 20 <= 4 + per * len(admitted), len(admitted)
    assert all(isinstance(v, Refusal) and v.what == "tokens" for v in verdicts[len(admitted) :])
    for ticket in admitted:  # the answers end: failed ones cost nothing, the rest 4 each
        local.charge(key, 0, ticket.reserved, now=now)
    assert isinstance(local.admit(key, 1, tokens_of(BODY.encode()), Ticket(), now=now), bytes)


class Ticket:
    reserved, shared, minute = 0, False, 0


LARGE = json.dumps({"model": "mock-llm", "max_tokens": 50_000, "prompt": "hi"}).encode()
SMALL = b'{"model":"mock-llm","max_tokens":1}'


def test_a_keys_small_answers_never_let_larger_requests_in_at_their_average() -> None:
    """After answers of 1 token, each request of a burst declaring max_tokens 50,000 reserved
    the key's average (1 token): 99,997 of them were admitted against tpm 100,000. Each
    reserves its own estimate now: tpm is passed by one request at most (local windows)."""
    from shoal.frontend.keys.windows import LocalWindows

    key = Grant(workspace="default", name="team", hash=hash_secret(SECRET), tpm=100_000)
    local, now = LocalWindows(), 600.0  # the start of a minute: nothing fades
    for _ in range(3):  # the key's answers: 1 token each
        ticket = Ticket()
        assert isinstance(local.admit(key, 1, tokens_of(SMALL), ticket, now=now), bytes)
        local.charge(key, 1, ticket.reserved, now=now)
    burst = [Ticket() for _ in range(1000)]
    verdicts = [local.admit(key, 1, tokens_of(LARGE), ticket, now=now) for ticket in burst]
    admitted = [t for t, v in zip(burst, verdicts, strict=True) if isinstance(v, bytes)]
    assert all(t.reserved == tokens_of(LARGE) for t in admitted)
    assert len(admitted) == 2  # 3 + 50,004 under 100,000: a second one, and no more
    assert 3 + sum(t.reserved for t in admitted[:-1]) < 100_000


async def test_redis_never_admits_larger_requests_at_a_keys_small_average(
    shared: Limits,
) -> None:
    """In Redis: after answers of 1 token, a request declaring max_tokens 50,000 reserved the
    key's average (1 token), on an allowance leased at that size or in a LEASE asked at it:
    500 of 500 were admitted against tpm 100,000. Each reserves its own estimate at least now:
    one declaring more than an allowance reserves asks Redis, and a LEASE is asked at the
    largest estimate of its waiters, even of one that came while it was asked."""
    key = Grant(workspace="default", name="team", hash=hash_secret(SECRET), tpm=100_000)
    for _ in range(3):  # a busy key answering 1 token: the next LEASE brings an allowance
        told = Told()
        told.tokens = tokens_of(SMALL)
        shared.wait(key, told)
        await wait_for(lambda told=told: told.verdicts)
        shared.charge(key, 1, told.reserved, told.shared, told.minute)
    small, large = Told(), Told()
    small.tokens, large.tokens = tokens_of(SMALL), tokens_of(LARGE)
    shared.wait(key, small)  # a LEASE asked at the small size, with an allowance...
    shared.wait(key, large)  # ... and a large request joins it while it is asked
    await wait_for(lambda: small.verdicts and large.verdicts)
    assert isinstance(large.verdicts[0], bytes) and large.reserved >= tokens_of(LARGE)
    burst = [Told() for _ in range(500)]
    for told in burst:
        told.tokens = tokens_of(LARGE)
        verdict = shared.admit(key, told.tokens, told)  # on the allowance (leased for 1 token)?
        if verdict is None:
            shared.wait(key, told)
        else:
            told.verdicts.append(verdict)
    await wait_for(lambda: all(told.verdicts for told in burst))
    admitted = [told for told in burst if isinstance(told.verdicts[0], bytes)]
    assert all(told.reserved >= tokens_of(LARGE) for told in admitted)
    assert len(admitted) <= 1  # the large one before holds ~50,000 of the 100,000 already


async def test_one_large_request_never_makes_the_small_ones_queued_before_it_reserve_its_size(
    shared: Limits,
) -> None:
    """A LEASE was asked at the largest estimate of every request waiting: 9 small requests
    (40 tokens) and then one of max_tokens 5,000 on a key of tpm 1,000 had the small ones
    reserve 5,020 each, and 8 of the 10 were refused (the local windows admit all 10). A
    LEASE is asked at its first waiter's size: the small ones are admitted at theirs, the
    large one waits for the next, asked at its own."""
    key = Grant(workspace="default", name="team", hash=hash_secret(SECRET), tpm=1000)
    small = json.dumps({"model": "m", "max_tokens": 20, "prompt": "hi"}).encode()
    large = json.dumps({"model": "m", "max_tokens": 5000, "prompt": "hi"}).encode()
    waiting = [Told() for _ in range(10)]
    for told, body in zip(waiting, [small] * 9 + [large], strict=True):
        told.tokens = tokens_of(body)
        verdict = shared.admit(key, told.tokens, told)
        if verdict is None:
            shared.wait(key, told)
        else:
            told.verdicts.append(verdict)
    await wait_for(lambda: all(told.verdicts for told in waiting))
    admitted = [isinstance(told.verdicts[0], bytes) for told in waiting]
    assert admitted == [True] * 10
    assert [told.reserved for told in waiting] == [tokens_of(small)] * 9 + [tokens_of(large)]


async def test_a_waiter_queued_before_its_key_gained_a_tpm_is_told_after_one_more_lease(
    shared: Limits,
) -> None:
    """A request queued while its key had no tpm, then the key's grant gained one: every
    LEASE answer stopped at it as larger than leased for and asked again at the same size,
    8,000 LEASEs in 2 s and the request never told. A LEASE is now asked at its first
    waiter's own size: it is told."""
    old = Grant(workspace="default", name="team", hash=hash_secret(SECRET), rpm=100_000)
    new = Grant(workspace="default", name="team", hash=hash_secret(SECRET), rpm=100_000,
                tpm=100_000)  # fmt: skip
    first, queued, later = Told(), Told(), Told()
    first.tokens = later.tokens = tokens_of(json.dumps({"model": "m", "max_tokens": 5}).encode())
    queued.tokens = tokens_of(json.dumps({"model": "m", "max_tokens": 500}).encode())
    before = shared.leases
    shared.wait(old, first)
    shared.wait(old, queued)
    shared.wait(new, later)
    await wait_for(lambda: first.verdicts and queued.verdicts and later.verdicts)
    assert all(isinstance(told.verdicts[0], bytes) for told in (first, queued, later))
    assert shared.leases - before <= 3


@pytest.mark.parametrize("shared", [False, True], ids=["local", "redis"])
async def test_tpm_holds_against_a_burst_of_requests_in_flight(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer, shared: bool,
) -> None:  # fmt: skip
    """40 requests at once on a key with tpm 20 (4 tokens an answer), all in flight together:
    each reserves the request's estimate (its body / 4 here, 19 tokens; the key's average
    answer only when larger), held until its answer ends; Redis or not, tpm is passed by one
    request at most."""
    worker = await start_worker("mock-llm")
    worker.stream_delay = 0.1  # each answer takes 0.3 s: the burst is in flight together
    await grant(store, tpm=20)
    front = await start_frontend(auth="keys", limits_url=redis_server.url if shared else None)
    await wait_for(
        lambda: "mock-llm" in front.registry.models and front.keys and front.keys.by_hash
    )
    await wait_for(lambda: front.limits.shared == shared)

    async def tokens() -> int:  # what the key's window holds
        if shared:
            return await counted(redis_server, "t")
        return front.limits.local._windows["default"]["team"].tokens  # type: ignore[no-any-return]

    async with aiohttp.ClientSession() as session:

        async def burst() -> list[int]:
            return [s for s, _ in await asyncio.gather(*(post(session, front) for _ in range(40)))]

        first = await burst()
        assert set(first) == {200, 429}
        assert first.count(200) <= 2, first  # 19 + 19 reserved: the second passes 20
        # the answers ended: 4 tokens each charged, the reservations given back
        await wait_for(lambda: _equals(tokens(), 4 * first.count(200)), timeout=5)
        second = await burst()  # 19 reserved each again, held while in flight
        assert 4 * first.count(200) + 4 * (second.count(200) - 1) < 20, second
        await wait_for(lambda: _equals(tokens(), 4 * (first + second).count(200)), timeout=5)


async def test_a_client_leaving_before_its_answer_is_charged_its_prompt(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """A request forwarded to an instance whose client left before the answer began (499)
    was charged 0 tokens to tpm and usage: a client could spend an engine's work for free by
    leaving early. Its prompt (the gateway's count: body bytes / 4) is charged now."""
    worker = await start_worker("mock-llm")
    worker.answering.clear()  # it reads the request and answers nothing
    await grant(store, tpm=1_000_000)
    front = await start_frontend(auth="keys")
    await wait_for(
        lambda: "mock-llm" in front.registry.models and front.keys and front.keys.by_hash
    )
    records: list[tuple[Any, ...]] = []
    front.gate.record = lambda *record: records.append(record)
    front.gate.records_usage = True
    body = json.dumps({"model": "mock-llm", "prompt": "word " * 4000})
    async with aiohttp.ClientSession() as session:

        async def ask() -> None:
            async with session.post(
                f"{front.url}/v1/completions",
                data=body,
                headers={"authorization": f"Bearer {SECRET}", "content-type": "application/json"},
            ) as response:
                await response.read()

        asking = asyncio.create_task(ask())
        await wait_for(lambda: worker.requests == 1)  # the instance has it
        asking.cancel()  # the client leaves
        await wait_for(lambda: records)
    worker.answering.set()
    _, _, _, status, prompt, completion = records[0]
    assert (status, prompt, completion) == (499, len(body) // 4, 0)
    assert front.limits.local._windows["default"]["team"].tokens == len(body) // 4


def test_retry_after_is_when_the_sliding_window_admits_again() -> None:
    """A 429's `Retry-After` (and `x-ratelimit-reset-*`) is when the sliding estimate has
    faded below the limit: a client that waits exactly that long is admitted, one that
    waits 1.5 s less is not. Many windows on an injected clock: the previous minute full
    or empty, this minute's own count under the limit or over it alone."""
    import copy
    import random

    from shoal.frontend.keys.windows import LocalWindows, Refusal

    rng = random.Random(7)
    for case in range(300):
        rpm, tpm = rng.choice([(rng.randint(1, 30), None), (None, rng.randint(5, 200))])
        key = Grant(workspace="default", name="team", hash=hash_secret(SECRET), rpm=rpm, tpm=tpm)
        local, minute = LocalWindows(), 6000 * 60.0
        for at in sorted(rng.uniform(0, 119.9) for _ in range(rng.randint(0, 40))):
            if isinstance(local.admit(key, 1, now=minute + at), bytes) and tpm:
                local.charge(key, rng.randint(0, 30), now=minute + at)
        now = minute + 120 + rng.uniform(0, 59.9)
        while not isinstance(refused := local.admit(key, 1, now=now), Refusal):
            if tpm:
                local.charge(key, rng.randint(1, 30), now=now)
        wait = refused.retry_after
        assert b"-%s: %ds" % (refused.what.encode(), wait) in refused.headers, case
        early = copy.deepcopy(local)
        assert isinstance(local.admit(key, 1, now=now + wait), bytes), (case, wait)
        if wait > 1:  # and not needlessly late
            assert isinstance(early.admit(key, 1, now=now + wait - 1.5), Refusal), case


async def test_the_lease_script_waits_as_long_as_the_local_windows(
    redis_server: RedisServer,
) -> None:
    """`LEASE`'s `wait` (Lua, on Redis' clock) is the local windows' `fade`, to the second."""
    import random
    import re

    from shoal.frontend.keys.windows import WINDOW, fade

    function = re.search(r"local function wait\(.*?\nend\n", limits.LEASE, re.S)
    assert function is not None
    script = (
        "local W, keep = tonumber(ARGV[1]), tonumber(ARGV[2])\n" + function.group(0)
        + "return wait(tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]))"
    )  # fmt: skip
    rng = random.Random(3)
    cases = [
        (rng.randint(0, 300), rng.randint(0, 300), rng.randint(0, 200), rng.uniform(0.001, 1))
        for _ in range(500)
    ]
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        for prev, cur, bound, keep in cases:
            if prev * keep + cur < bound:
                continue  # admitted: no wait asked
            lua = await client.eval(script, 0, WINDOW, repr(keep), prev, cur, bound)  # type: ignore[misc]
            assert lua == fade(prev, cur, bound, keep), (prev, cur, bound, keep)
    finally:
        await client.aclose()
