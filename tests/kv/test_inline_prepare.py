"""Chats are prepared on the event loop when that is cheap, and left to the tokenizer's thread
(`Deferred`) whenever the work could hold the loop: a long chat, a slow template, a slow
filter on a long value, much new text to tokenize, or the segments busy in the thread."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from shoal.frontend import Frontend
from shoal.frontend.kv import prompt as kv_prompt
from shoal.frontend.kv.prompt import (
    INLINE_CHAT,
    INLINE_MESSAGES,
    INLINE_NEW,
    Deferred,
    PromptTokenizer,
)
from shoal.worker.engines.mocker.text import VOCAB
from shoal.worker.engines.mocker.tokenizer import CHAT_TEMPLATE, TOKENIZER
from tests.helpers import LoopTurns
from tests.kv.probes import (
    BUDGET_READINGS,
    clock_by_readings,
    count_steps,
    count_tokenized,
    spy_filter,
)
from tests.kv.test_untrusted_prompts import MODEL, NESTED_LOOPS, figures, kv_set, start_front
from tests.processes import Processes

WRAPPED = "{% for m in messages %}{{ m['content'] | wordwrap(3) }}{% endfor %}"
URLIZED = "{% for m in messages %}{{ m['content'] | urlize }}{% endfor %}"
MANY_SPLITS = (
    "{% for m in messages %}{% for w in m['content'].split() %}{{ w }}{% endfor %}{% endfor %}"
)


def tokenizer(template: str = CHAT_TEMPLATE) -> PromptTokenizer:
    return PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})


def words(n: int, start: int = 0) -> str:
    return " ".join(VOCAB[(start + i) % 90] for i in range(n))


def test_a_short_chat_is_prepared_inline_and_hashed_as_in_the_thread() -> None:
    prompts = tokenizer()
    chat = [{"role": "system", "content": words(300)}, {"role": "user", "content": words(50, 7)}]
    inline = prompts.chat_hashes(chat, [16], 1024, inline=True)
    assert inline is not None and len(inline[16]) > 10
    assert inline == tokenizer().chat_hashes(chat, [16], 1024)


@pytest.mark.parametrize(
    ("template", "chat"),
    [
        (CHAT_TEMPLATE, [{"role": "user", "content": words(INLINE_CHAT)[: INLINE_CHAT + 1]}]),
        (CHAT_TEMPLATE, [{"role": "user", "content": words(INLINE_NEW)[: INLINE_NEW + 1]}]),
        (NESTED_LOOPS, [{"role": "user", "content": "hi"}]),
        (WRAPPED, [{"role": "user", "content": words(3000)}]),
        (URLIZED, [{"role": "user", "content": words(3000)}]),
        (MANY_SPLITS, [{"role": "user", "content": "a " * 6000}]),
        ("{{ 'x' * 5000000 }}", [{"role": "user", "content": "hi"}]),
        (CHAT_TEMPLATE, [{"role": "user", "content": "hi"}] * 300_000),
    ],
    ids=[
        "long-chat",
        "much-new-text",
        "slow-template",
        "wordwrap",
        "urlize",
        "loop",
        "huge-string",
        "many-messages",
    ],
)
async def test_work_that_could_hold_the_loop_is_deferred_quickly(
    template: str, chat: list[dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted, not timed: before `Deferred`, no more than `INLINE_MESSAGES` messages are
    looked at, the template's steps stay within the inline time budget, as readings of the
    sandbox's clocks (`clock_by_readings`), and no more than `INLINE_NEW` characters are
    tokenized."""
    prompts = tokenizer(template)
    clock_by_readings(monkeypatch)
    steps, tokenized = count_steps(prompts), count_tokenized(prompts)
    looked = LoopTurns().wrap(kv_prompt, "_message")
    try:
        with pytest.raises(Deferred):
            prompts.chat_hashes(chat, [16], 1024, inline=True)
    finally:
        for turns in (steps, tokenized, looked):
            await turns.stop()
    assert looked.on_loop <= INLINE_MESSAGES, f"{looked.on_loop} messages looked at"
    assert steps.on_loop <= BUDGET_READINGS, f"{steps.on_loop} steps of the template"
    assert tokenized.on_loop <= INLINE_NEW, f"{tokenized.on_loop} characters tokenized"
    assert prompts.renders  # an inline render never disables a template: the thread judges


@pytest.mark.parametrize("name", ["wordwrap", "urlize"])
def test_a_slow_filter_on_a_long_value_is_left_to_the_thread_before_it_runs(name: str) -> None:
    prompts = tokenizer("{% for m in messages %}{{ m['content'] | " + name + " }}{% endfor %}")
    ran: list[int] = []
    real = prompts.env.filters[name]

    def spy(*args: object, **kwargs: object) -> object:
        ran.append(1)
        return real(*args, **kwargs)

    spy.__name__ = f"do_{name}"
    prompts.env.filters[name] = prompts.env._bounded_filter(spy)  # as the sandbox wraps them
    long = [{"role": "user", "content": words(3000)}]
    with pytest.raises(Deferred):
        prompts.chat_hashes(long, [16], 1024, inline=True)
    assert not ran
    assert prompts.chat_hashes([{"role": "user", "content": "a short one"}], [16], 8, inline=True)
    assert prompts.chat_hashes(long, [16], 1024) is not None  # (in the thread: it runs)
    assert len(ran) == 2


def test_segments_busy_in_the_thread_defer_rather_than_wait() -> None:
    prompts = tokenizer()
    assert prompts.chain is not None
    chat = [{"role": "user", "content": "hi"}]
    # As while the thread tokenizes a long prompt:
    with prompts.chain._lock, pytest.raises(Deferred):
        prompts.chat_hashes(chat, [16], 1024, inline=True)
    assert prompts.chat_hashes(chat, [16], 1024, inline=True) is not None


@pytest.fixture
async def front(processes: Processes, tmp_path: Path) -> AsyncIterator[Frontend]:
    front = await start_front(processes, tmp_path)
    yield front
    await front.stop()


async def test_chats_go_inline_or_to_the_thread_and_the_loop_is_never_held(
    front: Frontend,
) -> None:
    state = kv_set(front)
    assert state.tokenizer is not None
    state.tokenizer = tokenizer(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ m['content'] | wordwrap(3) }}"
        "{% else %}<|user|>{{ m['content'] }}{% endif %}{% endfor %}<|assistant|>"
    )
    client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
    tokenized, wrapped = count_tokenized(state.tokenizer), LoopTurns()
    spy_filter(state.tokenizer, "wordwrap", wrapped)
    short = [{"role": "user", "content": words(200)}]
    await client.chat.completions.create(model=MODEL, messages=short, max_tokens=1)  # type: ignore[arg-type]
    assert tokenized.off_loop == 0  # no thread was needed
    assert figures(front).picks == 1 and figures(front).deferred == 0
    slow = [*short, {"role": "tool", "content": words(4000), "tool_call_id": "x"}]
    answers = await asyncio.gather(
        *(
            client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1)  # type: ignore[arg-type]
            for chat in (slow, [{"role": "user", "content": words(2500)}])
        )
    )
    assert all(a.choices for a in answers)
    assert figures(front).deferred == 2 and figures(front).picks == 3
    assert figures(front).fallbacks == 0  # prepared in the thread, routed by their blocks
    await tokenized.stop()
    await wrapped.stop()
    # Counted, not timed: the loop tokenized at most `INLINE_NEW` characters a turn, the
    # long chat was tokenized in the thread, and the slow filter ran there only.
    assert 0 < tokenized.most_per_turn <= INLINE_NEW, tokenized.per_turn
    assert tokenized.off_loop >= len(words(2500)), tokenized.off_loop
    assert wrapped.on_loop == 0 and wrapped.off_loop == 1
