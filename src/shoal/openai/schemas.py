"""Request bodies (chat and text completions, embeddings) as msgspec structs, and decoding.

A field the client did not send is `None` (or its OpenAI default where the answer does not
depend on it), so an engine can tell "not given" from a value and apply its own defaults.
Ranges are OpenAI's; vLLM's extensions are accepted so that an engine can honour or refuse
them by name. Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec

from shoal.bounds import TooDeep, check_json_depth
from shoal.openai.errors import ApiError, missing_parameter

T = TypeVar("T")

Positive = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's extension: with `include_usage`, every chunk carries the usage so far."""


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """One message; `content` is text or a list of parts (`[{"type": "text", ...}]`)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class SamplingRequest(msgspec.Struct, kw_only=True):
    """The fields chat and text completions share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Positive | None = None
    stop: str | list[str] | None = None
    n: int = 1
    seed: int | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    structural_tag: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    use_beam_search: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's disaggregated serving (NixlConnector): what a prefill hands to a decode."""

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries the usage so far (vLLM's
        `stream_options.continuous_usage_stats`, with `include_usage`)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class ChatRequest(SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    echo: bool = False
    """vLLM's extension: the answer starts with the last message when it is the assistant's."""
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    """vLLM's extension: whether the chat template ends with the assistant's turn opening."""
    continue_final_message: bool = False
    """vLLM's extension: the answer continues the last message (the assistant's), which the
    template leaves open (with `add_generation_prompt: false`)."""


class CompletionRequest(SamplingRequest, kw_only=True):
    prompt: str | list[Any]
    echo: bool = False
    suffix: str | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    best_of: int | None = None


class EmbeddingRequest(msgspec.Struct):
    model: str
    input: str | list[Any]
    dimensions: Annotated[int, msgspec.Meta(ge=1, le=8192)] | None = None
    encoding_format: str = "float"


_FIELD_RE = re.compile(r"field `([^`]+)`")
_PATH_RE = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")


def decode_request(body: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """Decode a JSON request body; raises `ApiError` 400 naming the parameter at fault."""
    try:
        check_json_depth(body)
        return decoder.decode(body)
    except TooDeep as exc:
        raise ApiError(400, f"Invalid request: {exc}", code="invalid_json") from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        missing = "missing required field" in text
        match = (_FIELD_RE.search(text) if missing else None) or _PATH_RE.search(text)
        param = match.group(1) if match else None
        if missing and param:
            raise missing_parameter(param) from None
        raise ApiError(400, f"Invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(
            400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
