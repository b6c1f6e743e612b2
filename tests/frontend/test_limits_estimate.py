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


@pytest.mark.parametrize("large", [False, True], ids=["small", "large-body"])
@pytest.mark.parametrize("shared", [False, True], ids=["local", "redis"])
async def test_a_burst_asking_n_choices_is_held_to_tpm_by_what_it_allows(
    store: Store, start_frontend: StartFrontend, redis_server: RedisServer, shared: bool,
    large: bool,
) -> None:  # fmt: skip
    """A request asking `n` choices allows `n` x `max_tokens` of completion (vLLM, SGLang and
    OpenAI's providers answer them all; OpenAI counts `n` x `max_tokens` against its limits),
    but reserved `max_tokens` once: 30 requests of `n` 50 and `max_tokens` 100 in flight
    together, under a tpm of 10,000, were all admitted and used 150,000 tokens (15 x tpm).
    The estimate counts each choice: two are admitted, the last one's overshoot its own (a
    body of 256 KiB or more, decoded in the decoder process, alike: 12 were admitted)."""
    import asyncio

    from tests.frontend.raw_upstream import RawUpstream

    release = asyncio.Event()

    async def choices(request: bytes, reader: Any, writer: Any) -> None:
        asked = json.loads(request.split(b"\r\n\r\n", 1)[1])
        await release.wait()  # (the burst is in flight together)
        completion = asked.get("n", 1) * asked["max_tokens"]
        body = json.dumps({
            "id": "x", "object": "chat.completion", "created": 1, "model": "mock-llm",
            "choices": [{"index": i, "message": {"role": "assistant", "content": "x"},
                         "finish_reason": "length"} for i in range(asked.get("n", 1))],
            "usage": {"prompt_tokens": 10, "completion_tokens": completion,
                      "total_tokens": 10 + completion},
        }).encode()  # fmt: skip
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip

    upstream = await RawUpstream(choices).start()
    try:
        await upstream.register(store)
        content, max_tokens = ("x" * (300 << 10), 10_000) if large else ("hi", 100)
        body = json.dumps({"model": "mock-llm", "n": 50, "max_tokens": max_tokens,
                           "messages": [{"role": "user", "content": content}]}).encode()  # fmt: skip
        size = len(body) // 4 + 50 * max_tokens  # what each allows
        tpm = 10_000 if not large else size * 3 // 2  # (two reach it)
        made = Grant(workspace="default", name="team", hash=hash_secret(SECRET), tpm=tpm)
        await store.put(made.key, made.to_json())
        front = await start_frontend(auth="keys", limits_url=redis_server.url if shared else None)
        await wait_for(lambda: "mock-llm" in front.registry.models and front.keys
                       and front.keys.by_hash and (front.limits.shared or not shared))  # fmt: skip
        burst = [asyncio.create_task(post(front, body)) for _ in range(30)]
        await wait_for(lambda: len(upstream.raw_requests) + sum(t.done() for t in burst) == 30)
        release.set()
        statuses = [status for status, _ in await asyncio.gather(*burst)]
    finally:
        release.set()
        await upstream.stop()
    assert set(statuses) <= {200, 429}, statuses
    # each reserves 50 x max_tokens + its body / 4: the second reaches tpm, the third refused
    assert statuses.count(200) == 2, statuses.count(200)


def test_the_estimate_counts_each_choice_a_request_asks() -> None:
    """`n`, or `best_of` if larger, multiplies the completion a request allows, at most
    `MAX_CHOICES` times; a value that is not a positive integer counts as one choice."""
    from shoal.frontend.proxy.fields import decode_fields

    def tokens(members: dict[str, Any]) -> int:
        body = json.dumps({"model": "m", **members}).encode()
        fields = decode_fields(body, with_tokens=True)
        declared = windows_module.estimate(
            len(body), fields.max_completion_tokens, fields.max_tokens, fields.n, fields.best_of
        )
        return declared - len(body) // 4

    assert tokens({"max_tokens": 7, "n": 3}) == 21
    assert tokens({"max_completion_tokens": 7, "n": 3, "best_of": 5}) == 35
    assert tokens({"max_tokens": 7, "n": 10**6}) == 7 * windows_module.MAX_CHOICES
    assert tokens({"n": 50}) == 0  # (no completion declared: the key's average covers it)
    for odd in (0, -3, "5", [5], None, 1.5):
        assert tokens({"max_tokens": 7, "n": odd}) == 7, odd
