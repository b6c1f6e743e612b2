"""What a request of a key with a tpm reserves when admitted (its estimate: body bytes / 4
plus the completion it allows), and what making it costs: its top-level `max_completion_tokens`
(else `max_tokens`), read from the fields the request path decodes anyway, once per request,
never by searching the body for every occurrence of the names (a 9 MB body quoting
`"max_tokens"` 700,000 times held the event loop ~550 ms per search, up to three searches a
request on the Redis path)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend import Frontend
from shoal.frontend import endpoints as endpoints_module
from shoal.frontend.keys import limits as limits_module
from shoal.frontend.keys import windows as windows_module
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.helpers import wait_for
from tests.redis_server import RedisServer

SECRET = "sk-shoal-" + "e" * 43
TPM = 10**9
DECOYS = 50_000  # `"max_tokens"` quoted as a value, before the real one (the fake worker
# takes bodies up to 1 MiB)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def decoy_body() -> bytes:
    """A chat request declaring `max_tokens` 4 at its top level, after the name quoted as a
    string `DECOYS` times and a nested object declaring 999,999 (a tool's own setting)."""
    return (
        b'{"model":"mock-llm","messages":[{"role":"user","content":"hi"}],"x":['
        + b",".join([b'"max_tokens"'] * DECOYS)
        + b'],"metadata":{"tool":{"max_tokens":999999}},"max_tokens":4}'
    )


async def keyed_frontend(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend, redis: str | None
) -> Frontend:
    await start_worker("mock-llm")
    made = Grant(workspace="default", name="team", hash=hash_secret(SECRET), tpm=TPM)
    await store.put(made.key, made.to_json())
    front = await start_frontend(auth="keys", limits_url=redis)
    await wait_for(
        lambda: "mock-llm" in front.registry.models and front.keys and front.keys.by_hash
    )
    if redis is not None:
        await wait_for(lambda: front.limits.shared)
    return front


async def post(front: Frontend, body: bytes) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{front.url}/v1/chat/completions",
            data=body,
            headers={"authorization": f"Bearer {SECRET}", "content-type": "application/json"},
        ) as response,
    ):
        await response.read()
        return response.status, response.headers


@pytest.mark.parametrize("shared", [False, True], ids=["local", "redis"])
async def test_a_request_reserves_its_top_level_max_tokens_whatever_its_body_quotes(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer, shared: bool,
) -> None:  # fmt: skip
    """The reservation (told in `x-ratelimit-remaining-tokens`) is the body's bytes / 4 plus
    the `max_tokens` the request itself declares, 4: neither the name quoted as a string nor
    a nested object's own `max_tokens` counts."""
    front = await keyed_frontend(
        store, start_worker, start_frontend, redis_server.url if shared else None
    )
    body = decoy_body()
    status, headers = await post(front, body)
    assert status == 200
    assert int(headers["x-ratelimit-remaining-tokens"]) == TPM - (len(body) // 4 + 4)


async def test_each_request_is_estimated_once_and_never_by_its_body(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend,
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """On the Redis path a request's estimate was made up to three times (when admitted on an
    allowance, for the `LEASE` asked at the first waiter's size, and again when its answer
    came), each a search of the whole body. Now it is made once, when the request comes, from
    the two values decoded with its other fields: what it is given is bounded (two values of
    a few bytes), whatever the body holds; the waiter keeps it."""
    front = await keyed_frontend(store, start_worker, start_frontend, redis_server.url)
    made: list[int] = []  # the bytes each estimate was given to read
    estimate = windows_module.estimate

    def counted(*args: Any) -> int:
        made.append(sum(len(a) for a in args if not isinstance(a, int)))
        return estimate(*args)

    for module in (windows_module, limits_module, endpoints_module):
        monkeypatch.setattr(module, "estimate", counted, raising=False)
    body = decoy_body()
    for _ in range(3):
        status, _ = await post(front, body)
        assert status == 200
    assert len(made) == 3, made  # one estimate a request
    assert max(made) <= len(b"4"), made  # the declared value's text, never the body


def test_the_estimate_reads_max_completion_tokens_else_max_tokens_as_integers() -> None:
    """As OpenAI counts a request against its limits: body bytes / 4, plus the completion it
    allows; a value that is not an integer of at most 9 digits allows nothing known."""
    from shoal.frontend.proxy.fields import decode_fields

    def tokens(members: dict[str, Any]) -> int:
        body = json.dumps({"model": "m", **members}).encode()
        fields = decode_fields(body, with_tokens=True)
        declared = windows_module.estimate(
            len(body), fields.max_completion_tokens, fields.max_tokens
        )
        return declared - len(body) // 4

    assert tokens({}) == 0
    assert tokens({"max_tokens": 7}) == 7
    assert tokens({"max_completion_tokens": 9, "max_tokens": 7}) == 9
    assert tokens({"max_completion_tokens": None, "max_tokens": 7}) == 7
    assert tokens({"max_completion_tokens": "9", "max_tokens": 7}) == 7
    for odd in (-3, "5", [5], {"n": 5}, True, 10**12, None):
        assert tokens({"max_tokens": odd}) == 0, odd
    assert tokens({"max_tokens": 999_999_999}) == 999_999_999
