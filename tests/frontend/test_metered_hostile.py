"""What an upstream answers under a key is read for usage only: a `model` that is not UTF-8
or a usage claim of a thousand digits never breaks the request's end, so the key's
`max_parallel` slot is given back and the next request is served."""

from __future__ import annotations

import asyncio
import gzip

import pytest

from shoal.discovery.grants import Grant, hash_secret
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
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


@pytest.mark.parametrize("upstream", ["worker", "provider"])
async def test_an_answer_is_asked_for_uncompressed_so_a_gzip_client_is_charged_its_usage(
    store: Store, start_raw: StartRaw, start_frontend: StartFrontend, upstream: str
) -> None:
    """The client's `Accept-Encoding: gzip` was forwarded (to a provider by its allow-list, to
    a worker with the rest of its headers); the upstream compressed its answer, the key's meter
    found no `usage` in the compressed bytes and charged the body / 4 as prompt and no
    completion token: tpm was never reached. Every forwarded request now asks for
    `Accept-Encoding: identity`, so the usage is read and charged in full."""
    import openai

    from shoal.discovery import Route, UrlTarget, publish_route
    from tests.frontend.conftest import openai_client

    async def answer(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        body = (
            b'{"id":"x","object":"chat.completion","created":1,"model":"mock-llm",'
            b'"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},'
            b'"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":90,'
            b'"total_tokens":100}}'
        )
        head = request.split(b"\r\n\r\n")[0].lower()
        encoding = b""
        if b"gzip" in head.partition(b"accept-encoding:")[2].split(b"\r\n")[0]:
            body, encoding = gzip.compress(body), b"content-encoding: gzip\r\n"
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + encoding
            + b"content-length: %d\r\n\r\n" % len(body) + body
        )  # fmt: skip

    raw = await start_raw(answer)
    grant = Grant(workspace="default", name="team", hash=hash_secret(SECRET), tpm=150)
    await store.put(grant.key, grant.to_json())
    frontend = await start_frontend(auth="keys")
    model = "mock-llm"
    if upstream == "provider":
        model = "remote"
        target = UrlTarget(base_url=f"{raw.raw_url}/v1", model="mock-llm")
        await publish_route(store, Route(workspace="default", name=model, targets=(target,)))
    await wait_for(
        lambda: (model in frontend.routes.models if upstream == "provider" else serving(frontend))
        and frontend.keys is not None and bool(frontend.keys.by_hash)
    )  # fmt: skip
    seen = []
    async with openai_client(
        frontend, api_key=SECRET, default_headers={"Accept-Encoding": "gzip"}
    ) as client:
        for _ in range(3):  # 100 tokens each: the third finds the window over 150
            try:
                await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}]
                )
                seen.append(200)
            except openai.RateLimitError:
                seen.append(429)
    assert seen == [200, 200, 429]
    heads = [r.split(b"\r\n\r\n")[0].lower() for r in raw.raw_requests]
    assert heads and all(b"accept-encoding: identity" in h and b"gzip" not in h for h in heads)


async def test_a_client_leaving_while_its_large_body_is_decoded_again_gives_the_keys_slot_back(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """A key's large body to a renaming alias whose members could not be decoded with its
    fields (more than `MAX_MEMBERS`: its rebuild answers 400) has them decoded again once
    admitted; a client that left meanwhile cancelled that decode, and nothing ended the
    request: its `max_parallel` slot was held for good (the key answered 429 on that
    frontend until it restarted), and its usage never recorded."""
    import socket
    import struct

    from shoal.discovery import FleetTarget, Route, publish_route
    from shoal.frontend.proxy.fields import LARGE_BODY, MAX_MEMBERS

    await start_worker("mock-llm")
    grant = Grant(workspace="default", name="team", hash=hash_secret(SECRET), max_parallel=1)
    await store.put(grant.key, grant.to_json())
    frontend = await start_frontend(auth="keys")
    alias = Route(workspace="default", name="alias", targets=(FleetTarget("mock-llm"),))
    await publish_route(store, alias)
    await wait_for(lambda: frontend.keys and frontend.keys.by_hash
                   and "alias" in frontend.routes.models
                   and frontend.routes.models["alias"].serving)  # fmt: skip
    filler = b"".join(b',"k%06x":0' % i for i in range(200 * MAX_MEMBERS))  # (decoded twice)
    body = b'{"model":"alias","messages":[{"role":"user","content":"hi"}]' + filler + b"}"
    assert len(body) >= LARGE_BODY
    head = POST.split(b"content-length:")[0].replace(b"mock-llm", b"alias")
    _, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    writer.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
    await wait_for(lambda: frontend.limits.in_flight, timeout=30)  # admitted: decoded again
    sock = writer.get_extra_info("socket")  # the client leaves (a reset)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
    await wait_for(lambda: not frontend.limits.in_flight, timeout=10)  # its place, given back
    small = BODY.replace(b"mock-llm", b"alias")
    received = await raw_exchange(
        frontend.port, head + b"content-length: %d\r\n\r\n" % len(small) + small
    )
    assert received.startswith(b"HTTP/1.1 200 "), received[:300]  # (429 before)
