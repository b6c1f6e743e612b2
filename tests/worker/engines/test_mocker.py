"""The mocker engine over HTTP: deterministic text, OpenAI wire format, timing, queueing."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from shoal.worker.engines.mocker import MockerEngine
from shoal.worker.engines.mocker.text import apply_stop, generate
from shoal.worker.engines.mocker.tokenizer import encode
from tests.helpers import wait_for

MODEL = "mock-model"
Make = Callable[..., Awaitable[tuple[MockerEngine, TestClient[Any, Any]]]]


@pytest.fixture
async def make_mocker() -> AsyncIterator[Make]:
    made: list[tuple[MockerEngine, TestClient[Any, Any]]] = []

    async def make(**kwargs: Any) -> tuple[MockerEngine, TestClient[Any, Any]]:
        engine = MockerEngine(MODEL, **kwargs)
        await engine.start()
        client: TestClient[Any, Any] = TestClient(
            TestServer(engine.app(), handler_cancellation=True)
        )
        await client.start_server()
        made.append((engine, client))
        return engine, client

    yield make
    for engine, client in made:
        await client.close()
        await engine.stop()


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def sse_events(resp: Any) -> list[Any]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    body = (await resp.read()).decode()
    assert body.endswith("data: [DONE]\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def test_same_prompt_same_text_and_max_tokens_is_honoured(make_mocker: Make) -> None:
    _, client = await make_mocker(speedup=0)
    first = await (await client.post("/v1/chat/completions", json=chat("hi", max_tokens=7))).json()
    second = await (await client.post("/v1/chat/completions", json=chat("hi", max_tokens=7))).json()
    other = await (await client.post("/v1/chat/completions", json=chat("bye", max_tokens=7))).json()

    text = first["choices"][0]["message"]["content"]
    assert text == second["choices"][0]["message"]["content"]
    assert text != other["choices"][0]["message"]["content"]
    assert len(text.split()) == 7
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 7
    assert first["usage"]["total_tokens"] == first["usage"]["prompt_tokens"] + 7
    assert first["object"] == "chat.completion" and first["id"] != second["id"]


async def test_stop_string_cuts_the_text_before_it_and_finishes_with_stop(
    make_mocker: Make,
) -> None:
    _, client = await make_mocker(speedup=0)
    full = await (await client.post("/v1/chat/completions", json=chat("x", max_tokens=12))).json()
    words = full["choices"][0]["message"]["content"].split(" ")
    stop = " " + words[4]
    cut = full["choices"][0]["message"]["content"].index(stop)

    resp = await client.post("/v1/chat/completions", json=chat("x", max_tokens=12, stop=[stop]))
    body = await resp.json()
    assert (
        body["choices"][0]["message"]["content"] == full["choices"][0]["message"]["content"][:cut]
    )
    assert body["choices"][0]["finish_reason"] == "stop"


def test_apply_stop_keeps_the_piece_that_completed_the_stop_string() -> None:
    pieces = generate(42, 6)
    kept, hit = apply_stop(pieces, [pieces[2].strip()[:2]])
    assert hit and len(kept) == 3 and "".join(kept) == "".join(pieces[:2]) + pieces[2][:1]


def test_apply_stop_counts_every_piece_up_to_the_one_that_completed_the_stop_string() -> None:
    pieces = ["a", " bb", " cc", " dd", " ee"]
    # Spanning two pieces: completed by " dd", so four pieces were generated.
    assert apply_stop(pieces, ["c d"]) == (["a", " bb", " c", ""], True)
    # On a boundary: " cc" starts where a piece starts and is completed by that piece.
    assert apply_stop(pieces, [" cc"]) == (["a", " bb", ""], True)
    assert apply_stop(pieces, [" cc"], include=True) == (["a", " bb", " cc"], True)
    assert apply_stop(pieces, ["zz", ""]) == (pieces, False)


def test_apply_stop_ends_at_the_stop_string_completed_first_not_the_one_starting_first() -> None:
    pieces = ["a", " bb", " cc", " dd", " ee"]
    # " bb cc dd" starts first but is completed by piece 3; " cc" is completed by piece 2.
    assert apply_stop(pieces, [" bb cc dd", " cc"]) == (["a", " bb", ""], True)
    # Both completed by the same piece: the first listed wins, as in vLLM's check.
    assert apply_stop(pieces, ["c", " cc"]) == (["a", " bb", " "], True)


async def test_streaming_chat_is_openai_sse_with_a_usage_chunk_and_done(
    make_mocker: Make,
) -> None:
    _, client = await make_mocker(ttft_ms=1, itl_ms=1)
    plain = await (await client.post("/v1/chat/completions", json=chat("s", max_tokens=5))).json()
    resp = await client.post(
        "/v1/chat/completions",
        json=chat("s", max_tokens=5, stream=True, stream_options={"include_usage": True}),
    )
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = await sse_events(resp)

    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_streaming_completions_without_usage_has_no_usage_field(make_mocker: Make) -> None:
    _, client = await make_mocker(speedup=0)
    plain = await (
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 4})
    ).json()
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 4, "stream": True}
    )
    chunks = (await sse_events(resp))[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("speedup", [0, 1])
async def test_a_stream_interval_puts_that_many_tokens_in_a_chunk_and_usage_counts_them(
    make_mocker: Make, speedup: float
) -> None:
    """`--stream-interval 3` sends 3 tokens a chunk (the last chunk what is left), the text
    of a chunk a token; with `continuous_usage_stats` each chunk carries the tokens so far."""
    _, client = await make_mocker(ttft_ms=1, itl_ms=1, speedup=speedup, stream_interval=3)
    plain = await (await client.post("/v1/chat/completions", json=chat("s", max_tokens=8))).json()
    options = {"include_usage": True, "continuous_usage_stats": True}
    resp = await client.post(
        "/v1/chat/completions",
        json=chat("s", max_tokens=8, stream=True, stream_options=options),
    )
    chunks = (await sse_events(resp))[:-1]
    pieces = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    text = "".join(c["choices"][0]["delta"]["content"] for c in pieces)
    assert text == plain["choices"][0]["message"]["content"]
    assert [c["usage"]["completion_tokens"] for c in pieces] == [3, 6, 8]
    assert all(c["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] for c in pieces)
    assert chunks[-1]["usage"] == plain["usage"]


async def test_cached_prefix_shortens_time_to_first_token(make_mocker: Make) -> None:
    engine, client = await make_mocker(ttft_ms=600, itl_ms=1, block_size=16)
    prompt = " ".join(f"w{i}" for i in range(512))

    async def ttft() -> float:
        start = time.monotonic()
        resp = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True},
        )
        await resp.content.readuntil(b"\n\n")
        elapsed = time.monotonic() - start
        await resp.read()
        return elapsed

    cold = await ttft()
    warm = await ttft()
    assert cold >= 0.55
    assert warm < cold / 4
    prompt_tokens = len(encode(prompt))
    assert engine.cache.hit_tokens == prompt_tokens - prompt_tokens % 16


async def test_requests_beyond_max_seqs_queue_and_all_complete(make_mocker: Make) -> None:
    engine, client = await make_mocker(ttft_ms=0, itl_ms=20, max_seqs=1)
    long = asyncio.create_task(client.post("/v1/chat/completions", json=chat("q", max_tokens=50)))
    await wait_for(lambda: engine.active_sequences == 1, message="the first request running")
    short = [
        asyncio.create_task(client.post("/v1/chat/completions", json=chat("q", max_tokens=2)))
        for _ in range(2)
    ]
    await wait_for(lambda: engine.waiting_requests == 2, message="two requests queued")
    assert engine.active_sequences == 1
    responses = await asyncio.gather(long, *short)
    assert [r.status for r in responses] == [200, 200, 200]
    assert engine.active_sequences == 0 and engine.waiting_requests == 0


async def test_client_disconnect_cancels_the_sequence_and_frees_its_slot(
    make_mocker: Make,
) -> None:
    engine, client = await make_mocker(ttft_ms=0, itl_ms=10, max_seqs=1)
    resp = await client.post(
        "/v1/chat/completions", json=chat("long", max_tokens=2000, stream=True)
    )
    await resp.content.readuntil(b"\n\n")
    await resp.content.readuntil(b"\n\n")
    assert engine.active_sequences == 1
    resp.close()

    await wait_for(lambda: engine.active_sequences == 0, message="the slot to be freed")
    assert engine.cancelled_sequences == 1
    assert engine.cache.blocks_in_use == 0
    again = await client.post("/v1/chat/completions", json=chat("next", max_tokens=2))
    assert again.status == 200


async def test_speedup_zero_answers_at_once(make_mocker: Make) -> None:
    engine, client = await make_mocker(ttft_ms=60_000, itl_ms=60_000, speedup=0)
    start = time.monotonic()
    resp = await client.post("/v1/chat/completions", json=chat("fast", max_tokens=50, stream=True))
    events = await sse_events(resp)
    assert time.monotonic() - start < 5
    assert len(events) == 50 + 3
    assert engine.generation_tokens == 50


async def test_embeddings_are_deterministic_unit_vectors_in_float_and_base64(
    make_mocker: Make,
) -> None:
    _, client = await make_mocker(speedup=0)
    req = {"model": MODEL, "input": ["alpha", "beta"], "dimensions": 32}
    floats = await (await client.post("/v1/embeddings", json=req)).json()
    packed = await (
        await client.post("/v1/embeddings", json={**req, "encoding_format": "base64"})
    ).json()

    a, b = (d["embedding"] for d in floats["data"])
    assert len(a) == 32 and a != b
    assert math.isclose(sum(v * v for v in a), 1.0, rel_tol=1e-6)
    decoded = struct.unpack("<32f", base64.b64decode(packed["data"][0]["embedding"]))
    assert all(
        math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) for x, y in zip(decoded, a, strict=True)
    )
    assert floats["usage"]["prompt_tokens"] == len(encode("alpha")) + len(encode("beta"))


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/v1/chat/completions", b"{not json", 400, None, "invalid_json"),
        (
            "/v1/chat/completions",
            b'{"model": "mock-model"}',
            400,
            "messages",
            "missing_required_parameter",
        ),
        (
            "/v1/chat/completions",
            json.dumps(chat("x") | {"model": "nope"}).encode(),
            404,
            "model",
            "model_not_found",
        ),
        (
            "/v1/completions",
            b'{"model": "mock-model", "prompt": "x", "max_tokens": "many"}',
            400,
            "max_tokens",
            None,
        ),
        ("/v1/nothing-here", b"{}", 404, None, None),
    ],
)
async def test_errors_use_the_openai_error_format(
    make_mocker: Make, path: str, body: bytes, status: int, param: str | None, code: str | None
) -> None:
    _, client = await make_mocker(speedup=0)
    resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == status
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["param"] == param and error["code"] == code


async def test_fake_lora_adapters_load_serve_and_unload(make_mocker: Make) -> None:
    engine, client = await make_mocker(speedup=0)
    served = await engine.load_adapter("my-lora", "/adapters/my-lora")
    assert served.adapter == "my-lora" and served.base_model == MODEL
    assert (
        served.metadata_dir is not None and (served.metadata_dir / "adapter_config.json").exists()
    )
    assert [m.name for m in await engine.served_models()] == [MODEL, "my-lora"]

    lora = await client.post(
        "/v1/chat/completions", json=chat("hi", max_tokens=6) | {"model": "my-lora"}
    )
    base = await client.post("/v1/chat/completions", json=chat("hi", max_tokens=6))
    lora_text = (await lora.json())["choices"][0]["message"]["content"]
    assert lora_text != (await base.json())["choices"][0]["message"]["content"]
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL, "my-lora"]

    await engine.unload_adapter("my-lora")
    gone = await client.post("/v1/chat/completions", json=chat("hi") | {"model": "my-lora"})
    assert gone.status == 404
    assert [m.name for m in await engine.served_models()] == [MODEL]


async def test_embeddings_refuse_dimensions_over_the_models_size_naming_the_field(
    make_mocker: Make,
) -> None:
    _, client = await make_mocker(speedup=0)
    resp = await client.post(
        "/v1/embeddings", json={"model": MODEL, "input": "alpha", "dimensions": 8192}
    )
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "dimensions" and "256" in error["message"]
    ok = await client.post("/v1/embeddings", json={"model": MODEL, "input": "a", "dimensions": 256})
    assert ok.status == 200


async def test_embeddings_refuse_more_inputs_than_the_bound_before_computing_any(
    make_mocker: Make,
) -> None:
    engine, client = await make_mocker(speedup=0)
    resp = await client.post(
        "/v1/embeddings", json={"model": MODEL, "input": ["word"] * 3000, "dimensions": 256}
    )
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "input"
    assert engine.requests["embeddings"] == 0


async def test_a_prompt_of_token_ids_over_the_context_is_refused_before_each_id_is_read(
    make_mocker: Make,
) -> None:
    _, client = await make_mocker(speedup=0)
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [[7] * 9000], "max_tokens": 1}
    )
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")


async def test_a_chat_of_many_messages_is_answered_like_a_short_one(make_mocker: Make) -> None:
    _, client = await make_mocker(speedup=0)
    messages = [{"role": "user", "content": "hi"}] * 1000
    resp = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}
    )
    assert resp.status == 200
    assert (await resp.json())["usage"]["prompt_tokens"] > 1000
