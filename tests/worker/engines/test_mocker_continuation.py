"""The mocker continues text as an engine does when a stream migrates: `continue_final_message`
in chat, the answer so far appended to the prompt in completions. With a seed, the
continuation of a prefix of an answer is the rest of that answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from shoal.worker.engines.mocker import MockerEngine

MODEL = "mock-model"

USER = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    engine = MockerEngine(MODEL, speedup=0)
    await engine.start()
    client: TestClient[Any, Any] = TestClient(TestServer(engine.app()))
    await client.start_server()
    yield client
    await client.close()
    await engine.stop()


async def _text(client: Any, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    data = await resp.json()
    choice = data["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"], data


@pytest.mark.parametrize("max_tokens", [40, None])
async def test_chat_continuing_a_prefix_of_an_answer_gives_the_rest_of_it(
    client: TestClient[Any, Any], max_tokens: int | None
) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": USER, "seed": 5, "temperature": 0}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    full, whole = await _text(client, "/v1/chat/completions", body)
    words = full.split(" ")
    for cut in (1, 7, len(words) - 1):
        prefix = " ".join(words[:cut])
        cont = {
            **body,
            "messages": [*USER, {"role": "assistant", "content": prefix}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
        if max_tokens is not None:
            cont["max_tokens"] = max_tokens - cut
        rest, data = await _text(client, "/v1/chat/completions", cont)
        assert prefix + rest == full
        assert data["usage"]["completion_tokens"] == len(words) - cut
        assert data["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] + cut
        assert data["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


async def test_completion_prompt_ending_with_a_prefix_of_its_answer_gives_the_rest(
    client: TestClient[Any, Any],
) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "seed": 9, "max_tokens": 30}
    full, _ = await _text(client, "/v1/completions", body)
    words = full.split(" ")
    for cut in (1, 12, 29):
        prefix = " ".join(words[:cut])
        rest, _ = await _text(
            client,
            "/v1/completions",
            {**body, "prompt": body["prompt"] + prefix, "max_tokens": 30 - cut},
        )
        assert prefix + rest == full


async def test_continuing_other_text_goes_on_with_fresh_words(client: TestClient[Any, Any]) -> None:
    body = {
        "model": MODEL,
        "messages": [*USER, {"role": "assistant", "content": "Zebras dance"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 3,
    }
    rest, _ = await _text(client, "/v1/chat/completions", body)
    assert rest.startswith(" ") and len(rest.split()) == 3


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"add_generation_prompt": True}, "continue_final_message"),
        ({"add_generation_prompt": False, "messages": USER}, "messages"),
    ],
)
async def test_continue_final_message_refused_as_vllm_does(
    client: TestClient[Any, Any], extra: dict[str, Any], param: str
) -> None:
    body = {
        "model": MODEL,
        "messages": [*USER, {"role": "assistant", "content": "the"}],
        "continue_final_message": True,
        **extra,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400
    assert json.loads(await resp.text())["error"]["param"] == param


def test_die_after_tokens_needs_a_positive_count_and_a_speedup() -> None:
    with pytest.raises(ValueError, match="die_after_tokens"):
        MockerEngine(MODEL, speedup=0, die_after_tokens=3)
    with pytest.raises(ValueError, match="die_after_tokens"):
        MockerEngine(MODEL, die_after_tokens=0)
