"""What the mocker refuses, as vLLM does: a field it cannot honour gets a 400 naming it.

The mocker stands in for vLLM, so every field that would change a real answer either
behaves as vLLM's does (`stop`, `seed`, `echo`, `ignore_eos`, `include_stop_str_in_output`,
`max_tokens`, `max_completion_tokens` winning over it, `add_generation_prompt`) or is
refused here. Sampling parameters are checked for type and range by
the schemas (`shoal.openai`) and leave the synthetic text as it is.
"""

from __future__ import annotations

from shoal.openai import ApiError, ChatRequest, CompletionRequest, SamplingRequest

_GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "structural_tag",
    "truncate_prompt_tokens",
    "allowed_token_ids",
)
"""vLLM's fields that constrain the text or cut the prompt: the mocker does neither."""

MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 65_536
"""Bounds on `stop`, checked before any text is searched: each stop string costs a search of
the whole answer on the event loop (OpenAI allows 4 strings; vLLM sets no bound)."""


def check_request(req: ChatRequest | CompletionRequest) -> None:
    """Refuse what the mocker cannot answer faithfully; the 400 names the field."""
    if req.stream_options is not None and not req.stream:
        raise ApiError(
            400,
            "stream_options is only allowed when stream is true.",
            param="stream_options",
        )
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stop) > MAX_STOP_STRINGS or sum(map(len, stop)) > MAX_STOP_CHARS:
        raise ApiError(
            400,
            f"stop: at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all "
            f"(got {len(stop)} strings).",
            param="stop",
        )
    field = unsupported(req)
    if field is not None:
        raise ApiError(
            400,
            f"The mocker does not support `{field}` as given: it would change the answer, "
            "and the mocker cannot honour it.",
            param=field,
            code="unsupported_parameter",
        )


def unsupported(req: ChatRequest | CompletionRequest) -> str | None:
    """The first field set to something the mocker cannot honour, if any."""
    if isinstance(req, ChatRequest):
        field = _unsupported_in_chat(req)
    else:
        field = _unsupported_in_completion(req)
    return field if field is not None else _unsupported_in_sampling(req)


def _unsupported_in_chat(req: ChatRequest) -> str | None:
    if req.logprobs:
        return "logprobs"
    if req.top_logprobs:
        return "top_logprobs"
    if req.tools and req.tool_choice != "none":
        return "tools"
    if req.functions and req.function_call != "none":
        return "functions"
    if req.tool_choice not in (None, "none", "auto"):
        return "tool_choice"
    if req.function_call not in (None, "none", "auto"):
        return "function_call"
    if req.audio is not None:
        return "audio"
    return None


def _unsupported_in_completion(req: CompletionRequest) -> str | None:
    if req.logprobs is not None:
        return "logprobs"
    if req.suffix:
        return "suffix"
    if req.best_of not in (None, 1):
        return "best_of"
    return None


def _unsupported_in_sampling(req: SamplingRequest) -> str | None:
    if req.n != 1:
        return "n"
    if req.logit_bias:
        return "logit_bias"
    if req.response_format and req.response_format.get("type") != "text":
        return "response_format"
    if req.min_tokens:
        return "min_tokens"
    if req.stop_token_ids:
        return "stop_token_ids"
    if req.bad_words:
        return "bad_words"
    if req.prompt_logprobs is not None:
        return "prompt_logprobs"
    if req.use_beam_search:
        return "use_beam_search"
    for name in _GUIDED:
        if getattr(req, name) is not None:
            return name
    return None
