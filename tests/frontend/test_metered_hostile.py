"""What an upstream answers under a key is read for usage only: a `model` that is not UTF-8
or a usage claim of a thousand digits never breaks the request's end, so the key's
`max_parallel` slot is given back and the next request is served."""

from __future__ import annotations

import asyncio

from shoal.discovery.grants import Grant, hash_secret
from shoal.store import Store
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import Behaviour, StartRaw, start_raw
from tests.frontend.support import raw_exchange, serving
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture

SECRET = "sk-shoal-" + "h" * 43
BODY = b'{"model":"mock-llm","messages":[{"role":"user","content":"hi"}]}'
POST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
    b"authorization: Bearer " + SECRET.encode() + b"\r\n"
    b"content-length: %d\r\n\r\n" % len(BODY) + BODY
)


def answering(model: bytes, prompt: bytes, completion: bytes) -> Behaviour:
    async def answer(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        body = (
            b'{"id":"x","object":"chat.completion","created":1,"model":"' + model + b'",'
            b'"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},'
            b'"finish_reason":"stop"}],"usage":{"prompt_tokens":' + prompt + b","
            b'"completion_tokens":' + completion + b',"total_tokens":1}}'
        )
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body
        )

    return answer


async def test_a_served_model_that_is_not_utf8_gives_the_keys_slot_back(
    store: Store, start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    await answered_three_times(store, start_raw, start_frontend,
                               answering(b"mock-\xff\xfe-llm", b"1", b"1"))  # fmt: skip


async def test_a_usage_of_a_thousand_digits_gives_the_keys_slot_back(
    store: Store, start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    await answered_three_times(store, start_raw, start_frontend,
                               answering(b"mock-llm", b"9" * 3000, b"9" * 1000))  # fmt: skip


async def answered_three_times(
    store: Store, start_raw: StartRaw, start_frontend: StartFrontend, behaviour: Behaviour
) -> None:
    await start_raw(behaviour)
    grant = Grant(workspace="default", name="team", hash=hash_secret(SECRET), max_parallel=1,
                  tpm=10**12)  # fmt: skip
    await store.put(grant.key, grant.to_json())
    frontend = await start_frontend(auth="keys")
    await wait_for(lambda: serving(frontend) and frontend.keys and frontend.keys.by_hash)
    for _ in range(3):
        received = await raw_exchange(frontend.port, POST, responses=1)
        assert received.startswith(b"HTTP/1.1 200 "), received[:200]
    assert not frontend.limits.in_flight


async def test_a_usage_followed_by_prompt_logprobs_is_charged_in_full(
    store: Store, start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """vLLM answers `usage` before its own fields (`prompt_logprobs`, `prompt_token_ids`,
    `kv_transfer_params`): a client asking for the logprobs of a long prompt pushed the usage
    out of the last 4 kB looked at, and its answers were charged no completion tokens."""
    import openai

    from tests.frontend.conftest import openai_client

    logprobs = b"[null," + b",".join(
        b'{"%d":{"logprob":-1.25,"rank":1,"decoded_token":"tok"}}' % n for n in range(300)
    ) + b"]"  # fmt: skip

    async def answer(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        body = (
            b'{"id":"x","object":"chat.completion","created":1,"model":"mock-llm",'
            b'"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},'
            b'"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"total_tokens":100,'
            b'"completion_tokens":90},"prompt_logprobs":' + logprobs + b"}"
        )
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body
        )

    await start_raw(answer)
    grant = Grant(workspace="default", name="team", hash=hash_secret(SECRET), tpm=150)
    await store.put(grant.key, grant.to_json())
    frontend = await start_frontend(auth="keys")
    await wait_for(lambda: serving(frontend) and frontend.keys and frontend.keys.by_hash)
    seen = []
    async with openai_client(frontend, api_key=SECRET) as client:
        for _ in range(3):  # 100 tokens each: the third finds the window over 150
            try:
                await client.chat.completions.create(
                    model="mock-llm", messages=[{"role": "user", "content": "hi"}]
                )
                seen.append(200)
            except openai.RateLimitError:
                seen.append(429)
    assert seen == [200, 200, 429]
