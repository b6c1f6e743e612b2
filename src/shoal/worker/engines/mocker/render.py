"""vLLM's render endpoints, as the mocker answers them: a request turned into token ids.

`POST /v1/chat/completions/render` answers one `GenerateRequest` (vLLM's token-in request:
`request_id`, `token_ids`, `features`, `sampling_params`, `model`, `stream`, ...), and
`POST /v1/completions/render` a list of them, one per prompt. Routers that route on KV
blocks (vllm-router's `kv_aware`) ask a worker to render a request so that they hash the
very ids the engine caches; the mocker's ids are its own tokenizer's over its own chat
template, the ones its prefix cache and KV events use.
"""

from __future__ import annotations

from typing import Any

from shoal.openai import SamplingRequest
from shoal.worker.engines.mocker.plan import context_exceeded


def render_max_tokens(
    max_tokens: int | None, prompt_tokens: int, context_length: int, param: str
) -> int:
    """The `max_tokens` of the rendered request, as vLLM sets it: the one asked for, else
    the room the prompt leaves; a 400 when the prompt (and what is asked) does not fit."""
    room = context_length - prompt_tokens
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        raise context_exceeded(context_length, prompt_tokens, param)
    return room if max_tokens is None else max_tokens


def generate_request(
    request_id: str,
    req: SamplingRequest,
    model: str,
    token_ids: list[int],
    max_tokens: int,
) -> dict[str, Any]:
    """The `GenerateRequest` vLLM's render endpoints answer for a request of these ids."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sampling = {
        "n": req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "seed": req.seed,
        "stop": stop,
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
    }
    stream_options = None
    if req.stream and req.stream_options is not None:
        stream_options = {"include_usage": req.include_usage}
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "features": None,
        "sampling_params": sampling,
        "model": model,
        "stream": req.stream,
        "stream_options": stream_options,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": req.kv_transfer_params,
    }
