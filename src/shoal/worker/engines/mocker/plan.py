"""What one request will produce (`Plan`), worked out before any waiting.

The answer depends only on the request: the model asked for, the seed, the prompt, the
token budget and the stop strings, so a plan is made up front and the simulation only
decides when its pieces come out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from shoal.openai import ApiError, SamplingRequest
from shoal.worker.engines.mocker.text import (
    VOCAB,
    apply_stop,
    carried_count,
    generate,
    pieces_of,
    seed_of,
)

MAX_CARRIED_WORDS = 8192
"""How far back from the end of a completions prompt a continuation is looked for."""
_VOCAB = frozenset(VOCAB)
_LONGEST = max(map(len, VOCAB))


@dataclass(frozen=True, slots=True)
class Plan:
    """The pieces of one answer, its prompt tokens and why it finishes."""

    model: str
    prompt_tokens: list[int]
    pieces: list[str]
    finish_reason: str
    echo: str = ""
    """Text the answer starts with before the generated pieces (`echo`), not counted."""
    transferred: int = 0
    """Prompt tokens whose KV a remote prefill handed over: no prefill is spent on them."""

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
    carried: str = "",
) -> Plan:
    """What `req` asking `model` will produce for `prompt` (its `tokens`).

    The text of the base model does not depend on its name, an adapter's does; without
    `max_tokens` the answer stops after a length drawn from the seed (or, with
    `ignore_eos`, runs to the context length).

    `carried`: text the answer continues (`tokens` count it, `prompt` does not). When it is
    the start of the answer `prompt` gets, the plan is the rest of that answer: a stream
    continued elsewhere ends as it would have (the same length when `max_tokens` is unset);
    other text is continued with fresh words.
    """
    if len(tokens) > context_length:
        raise context_exceeded(context_length, len(tokens))
    room = context_length - len(tokens)
    seed = "" if req.seed is None else req.seed
    name = model if model != base_model else ""
    seed_value = seed_of(name, seed, prompt)
    skip = 0  # pieces of the answer the carried text already holds
    if carried:
        known = carried_count(seed_value, carried)
        if known is not None:
            skip = known
        else:
            seed_value = seed_of(name, seed, prompt + carried)
    if max_tokens is None and req.ignore_eos:
        count, finish = room, "length"  # never an end of sequence: up to the context
    elif max_tokens is None:
        count, finish = max(min(16 + seed_value % 113, room + skip) - skip, 0), "stop"
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
    pieces = generate(seed_value, skip + count)
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        pieces, hit = apply_stop(pieces, stops, include=req.include_stop_str_in_output)
        if hit:
            finish = "stop"
    pieces = pieces[skip:]
    if carried and not skip and pieces and not carried[-1].isspace():
        pieces[0] = " " + pieces[0]  # other text: the fresh words follow it spaced
    return Plan(model, tokens, pieces, finish, echo)


def split_continuation(name: str, seed: int | None, prompt: str) -> tuple[str, str]:
    """A completions prompt as (prompt, carried): `carried` is the start of the answer to
    `prompt` that the prompt ends with (a stream continued elsewhere appends what it got
    to its prompt), else "" and the prompt whole.

    The end of the prompt is read back word by word while the words are the mocker's; each
    point where an answer could start is tried (the prompt before it hashed incrementally,
    O(prompt)), and the longest answer found wins.
    """
    starts: list[int] = []  # where an answer could start, from the end backwards
    end = len(prompt)
    for _ in range(MAX_CARRIED_WORDS):
        space = prompt.rfind(" ", max(end - _LONGEST - 1, 0), end)
        word = prompt[max(space + 1, end - _LONGEST) : end]
        # The answer's first word is glued to the prompt: any vocabulary word ending `word`.
        starts += (end - n for n in range(1, len(word) + 1) if word[-n:] in _VOCAB)
        if space < 0 or prompt[space + 1 : end] not in _VOCAB:
            break
        end = space
    if not starts:
        return prompt, ""
    digest = hashlib.blake2b(
        f"{name}\x1e{'' if seed is None else seed}\x1e".encode(), digest_size=8
    )
    at = 0
    best = len(prompt)
    for start in sorted(starts):
        digest.update(prompt[at:start].encode())
        at = start
        seed_value = int.from_bytes(digest.copy().digest(), "little")
        first = next(pieces_of(seed_value))
        if prompt.startswith(first, start) and carried_count(seed_value, prompt[start:]):
            best = start
            break
    return prompt[:best], prompt[best:]
