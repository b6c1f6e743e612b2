"""What one request will produce (`Plan`), worked out before any waiting.

The answer depends only on the request: the model asked for, the seed, the prompt, the
token budget and the stop strings, so a plan is made up front and the simulation only
decides when its pieces come out.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.openai import ApiError, SamplingRequest
from shoal.worker.engines.mocker.text import apply_stop, generate, seed_of


@dataclass(frozen=True, slots=True)
class Plan:
    """The pieces of one answer, its prompt tokens and why it finishes."""

    model: str
    prompt_tokens: list[int]
    pieces: list[str]
    finish_reason: str
    echo: str = ""
    """Text the answer starts with before the generated pieces (`echo`), not counted."""

    @property
    def text(self) -> str:
        return self.echo + "".join(self.pieces)

    def streamed_pieces(self) -> list[str]:
        """The text of each streamed chunk: the echo goes with the first piece."""
        if not self.echo:
            return self.pieces
        first = self.pieces[0] if self.pieces else ""
        return [self.echo + first, *self.pieces[1:]]

    @property
    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_tokens), len(self.pieces)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def context_exceeded(context_length: int, tokens: int, param: str = "messages") -> ApiError:
    """The 400 for a prompt of `tokens` tokens, over `context_length`."""
    return ApiError(
        400,
        f"This model's maximum context length is {context_length} tokens; the prompt has {tokens}.",
        param=param,
        code="context_length_exceeded",
    )


def make_plan(
    req: SamplingRequest,
    model: str,
    prompt: str,
    tokens: list[int],
    *,
    max_tokens: int | None,
    echo: str,
    base_model: str,
    context_length: int,
) -> Plan:
    """What `req` asking `model` will produce for `prompt` (its `tokens`).

    The text of the base model does not depend on its name, an adapter's does; without
    `max_tokens` the answer stops after a length drawn from the seed (or, with
    `ignore_eos`, runs to the context length).
    """
    if len(tokens) > context_length:
        raise context_exceeded(context_length, len(tokens))
    room = context_length - len(tokens)
    seed = "" if req.seed is None else req.seed
    seed_value = seed_of(model if model != base_model else "", seed, prompt)
    if max_tokens is None and req.ignore_eos:
        count, finish = room, "length"  # never an end of sequence: up to the context
    elif max_tokens is None:
        count, finish = min(16 + seed_value % 113, room), "stop"
    elif max_tokens > room:
        raise ApiError(
            400,
            f"max_tokens {max_tokens} plus the prompt's {len(tokens)} tokens exceeds the "
            f"context length {context_length}.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    else:
        count, finish = max_tokens, "length"
    pieces = generate(seed_value, count)
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        pieces, hit = apply_stop(pieces, stops, include=req.include_stop_str_in_output)
        if hit:
            finish = "stop"
    return Plan(model, tokens, pieces, finish, echo)
