"""An OpenAI request as llama.cpp's arguments: sampling options with their defaults,
`logit_bias` by token id, messages and prompts as llama.cpp takes them, and the
continuation of a final assistant message (`continue_final_message`), as vLLM does it.
"""

from __future__ import annotations

from typing import Any

from shoal.openai import ApiError, ChatMessage, SamplingRequest

# Sampling defaults where a request gives none: OpenAI's, and vLLM's extensions off.
_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for text completions


def _given(value: Any, name: str) -> Any:
    return _DEFAULTS[name] if value is None else value


def sampling_options(body: SamplingRequest, max_tokens: int | None) -> dict[str, Any]:
    """llama.cpp's keyword arguments for `body`'s sampling parameters."""
    if body.n != 1:
        raise ApiError(400, "Only n=1 is supported.", param="n")
    if body.stream_options is not None and not body.stream:
        raise ApiError(
            400, "stream_options is only allowed when stream is true.", param="stream_options"
        )
    return {
        "temperature": _given(body.temperature, "temperature"),
        "top_p": _given(body.top_p, "top_p"),
        "top_k": _given(body.top_k, "top_k"),
        "min_p": _given(body.min_p, "min_p"),
        "stop": body.stop or [],
        "seed": body.seed,
        "max_tokens": max_tokens,
        "presence_penalty": _given(body.presence_penalty, "presence_penalty"),
        "frequency_penalty": _given(body.frequency_penalty, "frequency_penalty"),
        "repeat_penalty": _given(body.repetition_penalty, "repetition_penalty"),
        "stream": body.stream,
    }


def continued_text(messages: list[dict[str, Any]], response_format: Any, logprobs: Any) -> str:
    """The final assistant message a `continue_final_message` request continues (its text);
    `ApiError` 400 when there is none, or with what a continuation cannot honour."""
    final = messages[-1] if messages else None
    content = None if final is None else final.get("content")
    if final is None or final.get("role") != "assistant" or not isinstance(content, str):
        raise ApiError(
            400,
            "continue_final_message needs the final message to be the assistant's, as text.",
            param="messages",
        )
    if not content:
        raise ApiError(
            400, "continue_final_message: the final assistant message is empty.", param="messages"
        )
    for given, name in ((response_format, "response_format"), (logprobs, "logprobs")):
        if given:
            raise ApiError(400, f"{name} is not supported with continue_final_message.", param=name)
    return content


def continue_chat(llm: Any, messages: list[dict[str, Any]], final: str, **kwargs: Any) -> Any:
    """On the engine thread: a chat answer that continues the final assistant message
    `final`, as vLLM does it: the model's chat template rendered without a generation
    prompt, cut after that message's text (before the template's end of turn), completed
    as text, and the completion returned in the chat format (streamed or whole)."""
    from llama_cpp import llama_chat_format  # (loaded with the model: no import cost here)

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        raise ApiError(
            400, "continue_final_message needs the model's chat template; it has none.",
            param="continue_final_message",
        )  # fmt: skip
    eos, bos = llm.token_eos(), llm.token_bos()
    formatter: Any = llama_chat_format.Jinja2ChatFormatter(
        template=template,
        eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
        bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
        add_generation_prompt=False,
        stop_token_ids=[eos],
    )
    rendered = formatter(messages=messages)
    end = rendered.prompt.rfind(final)
    if end < 0:
        raise ApiError(
            400, "continue_final_message: the chat template does not render the final "
            "assistant message as it is.", param="messages",
        )  # fmt: skip
    stop = kwargs.pop("stop", None) or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    template_stop = rendered.stop or []
    stop += [template_stop] if isinstance(template_stop, str) else template_stop
    prompt = rendered.prompt[: end + len(final)]  # (tokenized as llama.cpp's chat does)
    tokens = llm.tokenize(prompt.encode(), add_bos=not rendered.added_special, special=True)
    completion = llm.create_completion(
        prompt=tokens,
        stop=stop,
        stopping_criteria=rendered.stopping_criteria,
        **kwargs,
    )
    return llama_chat_format._convert_completion_to_chat(completion, stream=kwargs["stream"])


def token_bias(body: SamplingRequest, n_vocab: int) -> dict[int, float]:
    """`logit_bias` by token id (applied by the engine: llama-cpp-python drops it when
    a logits processor is also given)."""
    bias: dict[int, float] = {}
    for token, value in (body.logit_bias or {}).items():
        if not token.isdigit() or int(token) >= n_vocab:
            raise ApiError(400, f"logit_bias: {token!r} is not a token id.", param="logit_bias")
        bias[int(token)] = max(-100.0, min(100.0, value))
    return bias


def plain_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as llama.cpp takes them, content parts (`[{"type": "text", ...}]`) joined
    into plain text."""
    plain = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(
                part.get("text", "")
                for part in content
                if isinstance(part, dict) and part.get("type") == "text"
            )
        item: dict[str, Any] = {"role": message.role, "content": content}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls is not None:
            item["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        plain.append(item)
    return plain


def single_prompt(prompt: str | list[Any]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt  # token ids
    raise ApiError(400, "prompt must be one string or one list of token ids.", param="prompt")
