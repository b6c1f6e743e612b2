"""The mocker's render endpoints (vLLM's `/v1/chat/completions/render`, `/v1/completions/render`):
the ids a router hashes are the ids the mocker caches and reports, and bad input is refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from shoal.kv import BlockStored, decode_batch, wire_hash
from shoal.openai import ChatMessage
from shoal.worker.engines.mocker import MockerEngine
from shoal.worker.engines.mocker.text import VOCAB
from shoal.worker.engines.mocker.tokenizer import encode, render_chat

MODEL = "mock-model"
BS = 16
Make = Callable[..., Awaitable[tuple[MockerEngine, TestClient[Any, Any]]]]


@pytest.fixture
async def make_mocker() -> AsyncIterator[Make]:
    made: list[tuple[MockerEngine, TestClient[Any, Any]]] = []

    async def make(**kwargs: Any) -> tuple[MockerEngine, TestClient[Any, Any]]:
        engine = MockerEngine(MODEL, block_size=BS, **kwargs)
        await engine.start()
        client: TestClient[Any, Any] = TestClient(TestServer(engine.app()))
        await client.start_server()
        made.append((engine, client))
        return engine, client

    yield make
    for engine, client in made:
        await client.close()
        await engine.stop()


def words(seed: int, n: int) -> str:
    return " ".join(VOCAB[(seed * 31 + i * 7) % 200] for i in range(n))


CHAT = [
    {"role": "system", "content": "system " + words(1, 70)},
    {"role": "user", "content": words(2, 30) + ", and café?"},  # spelled and unknown pieces
    {"role": "assistant", "content": words(3, 25)},
    {"role": "user", "content": words(4, 23)},
]


def stored_tokens(engine: MockerEngine) -> list[int]:
    """The token ids of every block the engine's KV publisher has reported stored, in order."""
    assert engine.publisher is not None
    engine.publisher.flush()
    tokens: list[int] = []
    for _, payload in engine.publisher.buffer:
        for event in decode_batch(payload).events:
            if isinstance(event, BlockStored):
                tokens += event.token_ids
    return tokens


async def test_chat_render_gives_the_ids_its_prefix_cache_and_kv_events_hold(
    make_mocker: Make,
) -> None:
    engine, client = await make_mocker(kv_events_port=0, ttft_ms=0, itl_ms=0)
    resp = await client.post("/v1/chat/completions/render", json={"model": MODEL, "messages": CHAT})
    assert resp.status == 200
    rendered = await resp.json()
    ids = rendered["token_ids"]
    messages = [ChatMessage(role=m["role"], content=m["content"]) for m in CHAT]
    assert ids == encode(render_chat(messages))  # its own tokenizer over its own template
    assert rendered["model"] == MODEL and rendered["request_id"].startswith("chatcmpl-")
    assert rendered["sampling_params"]["max_tokens"] == engine.context_length - len(ids)
    full = len(ids) // BS * BS
    assert full >= 8 * BS and len(ids) > full  # several blocks and a partial one

    answer = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2}
    )
    assert (await answer.json())["usage"]["prompt_tokens"] == len(ids)
    # The blocks it cached for that chat are the blocks of the rendered ids, and its KV
    # events carry exactly those ids: a router hashing the render's ids sees its cache.
    hashes = engine.cache.block_hashes(ids)
    assert len(hashes) == full // BS and all(h in engine.cache for h in hashes)
    assert len(engine.cache) == len(hashes)
    assert stored_tokens(engine) == ids[:full]


async def test_a_mocker_publishing_tagged_maps_reports_the_same_blocks(make_mocker: Make) -> None:
    engines = [
        (await make_mocker(kv_events_port=0, ttft_ms=0, itl_ms=0, kv_events_format=form))[0]
        for form in ("array", "map")
    ]
    for engine in engines:
        client = TestClient(TestServer(engine.app()))
        await client.start_server()
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
        await client.close()
    array, tagged = engines
    assert stored_tokens(tagged) == stored_tokens(array) != []
    assert tagged.publisher is not None and array.publisher is not None
    [(_, payload)] = tagged.publisher.buffer
    [event] = msgspec.msgpack.decode(payload)[1]
    assert event["type"] == "BlockStored" and event["medium"] == "GPU"
    [(_, payload)] = array.publisher.buffer
    [stored] = decode_batch(payload).events
    assert isinstance(stored, BlockStored)
    assert event["block_hashes"] == [wire_hash(h) for h in stored.block_hashes]


async def test_render_follows_the_chat_options_as_the_answer_does(make_mocker: Make) -> None:
    _, client = await make_mocker()
    body = {"model": MODEL, "messages": CHAT, "add_generation_prompt": False}
    ids = (await (await client.post("/v1/chat/completions/render", json=body)).json())["token_ids"]
    messages = [ChatMessage(role=m["role"], content=m["content"]) for m in CHAT]
    assert ids == encode(render_chat(messages, add_generation_prompt=False))
    body = {"model": MODEL, "messages": CHAT, "max_completion_tokens": 5, "max_tokens": 9}
    rendered = await (await client.post("/v1/chat/completions/render", json=body)).json()
    assert rendered["sampling_params"]["max_tokens"] == 5  # the newer name wins, as in vLLM


async def test_completion_render_answers_one_request_per_prompt(make_mocker: Make) -> None:
    _, client = await make_mocker()
    text = words(5, 40)
    resp = await client.post("/v1/completions/render", json={"model": MODEL, "prompt": text})
    assert resp.status == 200
    [rendered] = await resp.json()
    assert rendered["token_ids"] == encode(text)
    given = [5, 6, 7, 8]
    resp = await client.post("/v1/completions/render", json={"model": MODEL, "prompt": [given]})
    assert [r["token_ids"] for r in await resp.json()] == [given]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions/render", b'{"model": "mock-model", "messages": [', 400, None),
        ("/v1/chat/completions/render", b"[" * 100 + b"]" * 100, 400, None),
        ("/v1/chat/completions/render", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions/render", {"messages": CHAT}, 400, "model"),
        ("/v1/chat/completions/render", {"model": "other", "messages": CHAT}, 404, "model"),
        (
            "/v1/chat/completions/render",
            {"model": MODEL, "messages": [{"role": "user", "content": "x " * 200}]},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions/render",
            {"model": MODEL, "messages": CHAT[:1], "max_tokens": 60},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions/render",
            {"model": MODEL, "messages": CHAT, "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        ("/v1/completions/render", {"model": MODEL, "prompt": ["one", "two"]}, 400, "prompt"),
        ("/v1/completions/render", {"model": MODEL, "prompt": list(range(200))}, 400, "prompt"),
    ],
    ids=[
        "truncated-json",
        "nested-too-deep",
        "no-messages",
        "no-model",
        "unknown-model",
        "over-the-context",
        "max-tokens-past-the-room",
        "stream-options-without-stream",
        "two-prompts",
        "ids-over-the-context",
    ],
)
async def test_bad_render_requests_get_an_openai_error(
    make_mocker: Make, path: str, body: Any, status: int, param: str | None
) -> None:
    # A context of 128 tokens: the system message alone (~73 tokens) leaves under 60.
    _, client = await make_mocker(context_length=128)
    if isinstance(body, bytes):
        resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    else:
        resp = await client.post(path, json=body)
    assert resp.status == status
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param


async def test_a_long_prompt_is_tokenized_with_the_gil_let_go() -> None:
    """A long prompt is tokenized in a thread, but `Tokenizer.encode` keeps the GIL for its
    whole call: 60,000 words held the mocker's loop (its answers, its lease's renewal)
    ~50-75 ms all the same. Its batch call lets the GIL go while it works. Counted, not
    timed: the loop's turns while the thread is inside `encode` (the switch interval made
    long, so only a call that lets the GIL go lets the loop turn), and the ids are the same."""
    import sys

    from shoal.worker.engines.mocker import tokenizer

    words = sorted(VOCAB)
    text = " ".join(words[i % len(words)] for i in range(60_000)) + " héllo ☃ <|user|>"
    inside = [False]
    turns_inside = 0
    spinning = True

    async def spin() -> None:  # (a turn of the loop whenever it may have one)
        nonlocal turns_inside
        while spinning:
            turns_inside += inside[0]
            await asyncio.sleep(0)

    def tokenized() -> list[int]:
        inside[0] = True
        try:
            return encode(text)
        finally:
            inside[0] = False

    interval = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    spinner = asyncio.create_task(spin())
    try:
        ids = await asyncio.to_thread(tokenized)
    finally:
        sys.setswitchinterval(interval)
        spinning = False
        await spinner
    assert ids == tokenizer.TOKENIZER.encode(text, add_special_tokens=False).ids
    assert len(ids) > 60_000
    assert turns_inside >= 10, f"the loop turned {turns_inside} times while the thread tokenized"
