"""A key's limits are the key's, whichever of its live secrets a request bears: during a
rotation's overlap (up to 16 live secrets) they are not multiplied."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker, openai_client
from tests.helpers import wait_for
from tests.redis_server import RedisServer

OLD = "sk-shoal-" + "o" * 43
NEW = "sk-shoal-" + "n" * 43
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


async def secrets_of_one_key(store: Store, **limits: int) -> None:
    for secret in (OLD, NEW):  # as the controller publishes a key being rotated
        made = Grant(workspace="default", name="team", hash=hash_secret(secret), **limits)  # type: ignore[arg-type]
        await store.put(made.key, made.to_json())


async def statuses(fronts: list[Frontend], requests: int) -> list[int]:
    seen: list[int] = []
    for n in range(requests):
        secret = (OLD, NEW)[n % 2]
        async with openai_client(fronts[n % len(fronts)], api_key=secret) as client:
            try:
                await client.chat.completions.create(model="mock-llm", messages=CHAT)  # type: ignore[arg-type]
                seen.append(200)
            except openai.RateLimitError:
                seen.append(429)
    return seen


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "local"])
async def test_the_secrets_of_a_rotated_key_share_its_rpm(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    redis_server: RedisServer,
    shared: bool,
) -> None:
    await start_worker("mock-llm")
    await secrets_of_one_key(store, rpm=6)
    url = redis_server.url if shared else None
    fronts = [await start_frontend(auth="keys", limits_url=url) for _ in (1, 2) if shared or _ == 1]
    await wait_for(
        lambda: all("mock-llm" in f.registry.models and len(f.keys.by_hash) == 2 for f in fronts)  # type: ignore[union-attr]
    )
    if shared:
        await wait_for(lambda: all(f.limits.shared and f.limits.frontends == 2 for f in fronts))
    seen = await statuses(fronts, 12)
    assert seen.count(200) == 6, seen  # not 6 for each secret


async def test_the_secrets_of_a_rotated_key_share_its_max_parallel(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """`max_parallel` counts the key's requests in flight, whichever secret they bear."""
    await start_worker("mock-llm")
    await secrets_of_one_key(store, max_parallel=1)
    frontend = await start_frontend(auth="keys")
    await wait_for(lambda: "mock-llm" in frontend.registry.models)
    old = Grant(workspace="default", name="team", hash=hash_secret(OLD), max_parallel=1)
    new = Grant(workspace="default", name="team", hash=hash_secret(NEW), max_parallel=1)
    assert frontend.limits.enter(old) is None  # one in flight with the old secret
    refused = frontend.limits.enter(new)
    assert refused is not None and refused.status == 429
    frontend.limits.leave(old)
    assert frontend.limits.enter(new) is None
    frontend.limits.leave(new)
