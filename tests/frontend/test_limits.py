"""API keys' limits across frontends, on a real Redis (`tests/redis_server.py`): rpm and tpm
shared by three frontends, 429s with the headers clients read, Redis killed and back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.helpers import wait_for
from tests.redis_server import RedisServer

SECRET = "sk-shoal-" + "c" * 43
BODY = json.dumps({"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]})


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
            assert answered.count(200) in (9, 10), answered  # 30 / 3 here, this one included

        redis_server.start()
        await wait_for(lambda: all(f.limits.shared for f in fronts), timeout=5)
        assert (await health(fronts[0]))["state"] == "shared"
        answered = [(await post(session, fronts[0]))[0] for _ in range(40)]
        assert abs(answered.count(200) - 30) <= 1, answered  # one frontend, the whole limit
        assert (await post(session, fronts[1]))[0] == 429  # and it is shared
