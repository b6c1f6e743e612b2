"""The mocker stands in for vLLM: each OpenAI field either behaves as vLLM's does or is refused
with a 400 naming it, never silently ignored. Driven by the official `openai` client over a
real socket, on both the instant path (`speedup=0`) and the timed one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import jinja2
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from shoal.worker.engines.mocker import MockerEngine
from shoal.worker.engines.mocker.conformance import MAX_STOP_STRINGS
from shoal.worker.engines.mocker.tokenizer import CHAT_TEMPLATE, encode
from tests.worker.engines.support import client_for, engine_served

MODEL = "mock-model"
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(params=[0.0, 1000.0], ids=["instant", "timed"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[openai.AsyncOpenAI]:
    engine = MockerEngine(MODEL, speedup=request.param)
    async with engine_served(engine) as (_, server), client_for(server) as client:
        yield client


def render_chat_template(messages: Any, *, add_generation_prompt: bool) -> str:
    """The prompt the published chat template renders (what a frontend would tokenize)."""
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt)


async def streamed_completion(client: openai.AsyncOpenAI, **kwargs: Any) -> list[str]:
    """The text pieces of a streamed completion, in order."""
    stream = await client.completions.create(model=MODEL, stream=True, **kwargs)
    return [chunk.choices[0].text async for chunk in stream if chunk.choices]


async def streamed_chat(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[str, Any]:
    """The text and usage of a streamed chat completion."""
    stream = await client.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    return text, usage


async def test_echo_prepends_the_prompt_streamed_or_not(client: openai.AsyncOpenAI) -> None:
    prompt = "Once upon a time"
    plain = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    echoed = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.usage == plain.usage  # echo adds no generated tokens
    pieces = await streamed_completion(client, prompt=prompt, max_tokens=5, echo=True)
    assert "".join(pieces) == echoed.choices[0].text


async def test_chat_echo_prepends_the_last_assistant_message_as_vllm_does(
    client: openai.AsyncOpenAI,
) -> None:
    start: list[ChatCompletionMessageParam] = [*USER, {"role": "assistant", "content": "Once"}]
    plain = await client.chat.completions.create(model=MODEL, messages=start, max_tokens=4)
    echoed = await client.chat.completions.create(
        model=MODEL, messages=start, max_tokens=4, extra_body={"echo": True}
    )
    assert echoed.choices[0].message.content == "Once" + (plain.choices[0].message.content or "")
    text, _ = await streamed_chat(client, messages=start, max_tokens=4, extra_body={"echo": True})
    assert text == echoed.choices[0].message.content
    # The last message is the user's: nothing to echo.
    user_last = await client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, extra_body={"echo": True}
    )
    assert (
        user_last.choices[0].message.content
        == (await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4))
        .choices[0]
        .message.content
    )


async def refused(call: Any) -> dict[str, Any]:
    """The OpenAI error body of a request that must be refused with 400."""
    with pytest.raises(openai.BadRequestError) as caught:
        await call
    assert isinstance(caught.value.body, dict)
    return caught.value.body


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_zero_max_tokens_is_refused_like_vllm(client: openai.AsyncOpenAI, field: str) -> None:
    error = await refused(
        client.chat.completions.create(model=MODEL, messages=USER, extra_body={field: 0})
    )
    assert error["param"] == field
    error = await refused(client.completions.create(model=MODEL, prompt="x", max_tokens=0))
    assert error["param"] == "max_tokens"


async def test_stream_options_without_stream_is_refused_like_vllm(
    client: openai.AsyncOpenAI,
) -> None:
    options: Any = {"include_usage": True}
    error = await refused(
        client.chat.completions.create(model=MODEL, messages=USER, stream_options=options)
    )
    assert error["param"] == "stream_options" and "stream" in error["message"]
    error = await refused(
        client.completions.create(model=MODEL, prompt="x", stream=False, stream_options=options)
    )
    assert error["param"] == "stream_options"


CHANGES_THE_ANSWER = [
    ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        "tools",
    ),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"logit_bias": {"42": 100}}, "logit_bias"),
    ("chat", {"temperature": 5}, "temperature"),
    ("chat", {"temperature": "hot"}, "temperature"),
    ("chat", {"top_p": 1.5}, "top_p"),
    ("chat", {"presence_penalty": "high"}, "presence_penalty"),
    ("chat", {"guided_json": {"type": "object"}}, "guided_json"),
    ("completions", {"logprobs": 2}, "logprobs"),
    ("completions", {"suffix": "The end."}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"min_tokens": 4}, "min_tokens"),
    ("chat", {"truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("completions", {"truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("chat", {"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ("completions", {"allowed_token_ids": [5]}, "allowed_token_ids"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("chat", {"structural_tag": '{"type": "structural_tag"}'}, "structural_tag"),
]


@pytest.mark.parametrize(("kind", "extra", "param"), CHANGES_THE_ANSWER)
async def test_a_field_that_would_change_the_answer_is_refused_naming_it(
    client: openai.AsyncOpenAI, kind: str, extra: dict[str, Any], param: str
) -> None:
    if kind == "chat":
        call: Any = client.chat.completions.create(model=MODEL, messages=USER, extra_body=extra)
    else:
        call = client.completions.create(model=MODEL, prompt="x", extra_body=extra)
    error = await refused(call)
    assert error["param"] == param
    assert param in error["message"]


HARMLESS = [
    {"logprobs": False},
    {"top_logprobs": 0},
    {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "none",
    },
    {"response_format": {"type": "text"}},
    {"logit_bias": {}},
    {"temperature": 0.7, "top_p": 0.9, "presence_penalty": 1, "frequency_penalty": -1},
    {"use_beam_search": False},
    {"add_generation_prompt": True},
]


@pytest.mark.parametrize("extra", HARMLESS)
async def test_a_field_set_to_what_changes_nothing_is_accepted(
    client: openai.AsyncOpenAI, extra: dict[str, Any]
) -> None:
    plain = await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6)
    same = await client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, extra_body=extra
    )
    assert same.choices[0].message.content == plain.choices[0].message.content


async def test_seed_zero_is_a_seed_like_any_other(client: openai.AsyncOpenAI) -> None:
    async def text(**kwargs: Any) -> str | None:
        answer = await client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=8, **kwargs
        )
        return answer.choices[0].message.content

    unseeded, zero, one = await text(), await text(seed=0), await text(seed=1)
    assert zero == await text(seed=0)
    assert len({unseeded, zero, one}) == 3


async def test_a_stop_string_on_a_piece_boundary_counts_the_token_that_completed_it(
    client: openai.AsyncOpenAI,
) -> None:
    prompt = "The story of a long day"
    pieces = await streamed_completion(client, prompt=prompt, max_tokens=16)
    text = "".join(pieces)
    # A stop string that is exactly piece k, found nowhere earlier: it starts on a boundary.
    k = next(k for k in range(1, len(pieces)) if text.find(pieces[k]) == len("".join(pieces[:k])))
    stopped = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, stop=[pieces[k]]
    )
    assert stopped.choices[0].text == "".join(pieces[:k])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None
    assert stopped.usage.completion_tokens == k + 1  # pieces 0..k were generated
    streamed = await streamed_completion(client, prompt=prompt, max_tokens=16, stop=[pieces[k]])
    assert "".join(streamed) == stopped.choices[0].text
    kept = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        stop=[pieces[k]],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == "".join(pieces[: k + 1])
    assert kept.usage is not None and kept.usage.completion_tokens == k + 1


async def test_ignore_eos_generates_up_to_the_context_like_vllm(
    client: openai.AsyncOpenAI,
) -> None:
    plain = await client.completions.create(model=MODEL, prompt="Go on")
    endless = await client.completions.create(
        model=MODEL, prompt="Go on", extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].finish_reason == "stop"
    assert endless.choices[0].finish_reason == "length"
    assert plain.usage is not None and endless.usage is not None
    assert endless.usage.total_tokens == 8192  # the mocker's context length


async def test_max_completion_tokens_wins_over_max_tokens_like_vllm(
    client: openai.AsyncOpenAI,
) -> None:
    both = await client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, extra_body={"max_completion_tokens": 10}
    )
    assert both.usage is not None and both.usage.completion_tokens == 10
    assert both.choices[0].finish_reason == "length"


async def test_add_generation_prompt_false_leaves_the_assistant_marker_out_like_vllm(
    client: openai.AsyncOpenAI,
) -> None:
    with_marker = await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    without = await client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, extra_body={"add_generation_prompt": False}
    )
    assert with_marker.usage is not None and without.usage is not None
    rendered = render_chat_template(USER, add_generation_prompt=False)
    assert without.usage.prompt_tokens == len(encode(rendered))
    assert without.usage.prompt_tokens < with_marker.usage.prompt_tokens


async def test_a_stop_list_over_the_bound_is_refused_before_any_text_is_searched(
    client: openai.AsyncOpenAI,
) -> None:
    stop = [f"s{i:09d}" for i in range(200_000)]  # 2.8 MB: held the loop 2.5 s before
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=5, stop=stop)
    assert refused.value.body["param"] == "stop"  # type: ignore[index]
    answer = await client.completions.create(
        model=MODEL, prompt="hi", max_tokens=5, stop=stop[:MAX_STOP_STRINGS]
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
