"""Counting the work a prompt's preparation does, and where: the characters a tokenizer
encodes and the steps a chat template takes, per turn of the event loop or in the thread
they ran in (`tests.helpers.LoopTurns`), and the sandbox's clocks turned by its own readings,
so that its inline time budget is a count of them."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import Tokenizer

from shoal.frontend.kv import prompt as kv_prompt
from shoal.frontend.kv import sandbox
from shoal.frontend.kv.prompt import PromptTokenizer
from tests.helpers import LoopTurns

BUDGET_READINGS = 100
"""An inline render's time budget (`sandbox.INLINE_SECONDS`), in readings of the sandbox's
clocks once `clock_by_readings` turns them (each reading `TICK` past the last): a render
that checks its budget at every step is deferred within about this many steps."""
TICK = sandbox.INLINE_SECONDS / BUDGET_READINGS


def clock_by_readings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox's clocks (wall and CPU) advance `TICK` at each reading, and only then:
    how much a render does within its time budget no longer depends on the machine."""
    readings = itertools.count()

    def now() -> float:
        return next(readings) * TICK

    monkeypatch.setattr(sandbox, "time", SimpleNamespace(monotonic=now, thread_time=now))


class CountedTokenizer:
    """A `tokenizers.Tokenizer` that notes in `turns` the characters it encodes (on the
    event loop per turn, or in the thread encoding them); anything else as the real one."""

    def __init__(self, tokenizer: Tokenizer, turns: LoopTurns) -> None:
        self._tokenizer = tokenizer
        self._turns = turns

    def encode_batch_fast(self, texts: list[str], *args: Any, **kwargs: Any) -> Any:
        self._turns.note(sum(len(text) for text in texts))
        return self._tokenizer.encode_batch_fast(texts, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def count_tokenized(prompts: PromptTokenizer) -> LoopTurns:
    """The characters `prompts` tokenizes from now on, per turn of the loop (`on_loop`,
    `most_per_turn`) or in its thread (`off_loop`)."""
    turns = LoopTurns()
    counted: Any = CountedTokenizer(prompts.tokenizer, turns)
    prompts.tokenizer = counted
    if prompts.chain is not None:  # (it encodes with the tokenizer it was made for)
        prompts.chain._encode = functools.partial(kv_prompt._encode, counted, special_tokens=False)
        prompts.chain._encode_many = functools.partial(kv_prompt._plain_many, counted)
    return turns


def count_steps(prompts: PromptTokenizer) -> LoopTurns:
    """The steps `prompts`' templates take from now on (each loop iteration, call, attribute
    or item read the sandbox checks), per turn of the loop or in the tokenizer's thread."""
    return LoopTurns().wrap(prompts.env, "check")


def spy_filter(prompts: PromptTokenizer, name: str, turns: LoopTurns) -> None:
    """Note in `turns` each run of the template filter `name` (bounded as the sandbox
    bounds its own: the check before it runs is not a run)."""
    real: Callable[..., Any] = prompts.env.filters[name]

    def spy(*args: Any, **kwargs: Any) -> Any:
        turns.note()
        return real(*args, **kwargs)

    spy.__name__ = f"do_{name}"
    prompts.env.filters[name] = prompts.env._bounded_filter(spy)
