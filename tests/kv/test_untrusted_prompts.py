"""What a worker publishes (its chat template) and what a client sends (its prompt) never
block a `--router kv` frontend's event loop, grow its memory without a byte bound, or turn
into a 500: a real frontend, real mocker workers, the official openai client."""

from __future__ import annotations

import asyncio
import threading
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from tokenizers import Tokenizer

from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.kv import prompt as kv_prompt
from shoal.frontend.kv.prompt import INLINE_NEW, PromptTokenizer, TemplateOverrun
from shoal.frontend.kv.router import KvRouter
from shoal.frontend.kv.sandbox import INT_BITS
from shoal.frontend.kv.tracker import KvSet
from shoal.worker.engines.mocker.text import VOCAB
from shoal.worker.engines.mocker.tokenizer import CHAT_TEMPLATE, TOKENIZER
from tests.helpers import LoopTurns, wait_for
from tests.kv.probes import count_steps, count_tokenized
from tests.processes import Processes

MODEL = "kv-untrusted"
WORKER_FLAGS = (
    "--lease-ttl", "2", "--ttft-ms", "1", "--itl-ms", "1", "--block-size", "16",
    "--kv-events-port", "0",
)  # fmt: skip
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# Mistral's templates check tool call ids like this (and raise otherwise).
MISTRAL_LIKE = """{%- for message in messages %}
{%- if message.role == 'tool' %}
{%- if message.tool_call_id is not defined or message.tool_call_id|length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}
{{- '[TOOL_RESULTS]' ~ message.tool_call_id ~ ' ' ~ message.content ~ '[/TOOL_RESULTS]' }}
{%- elif message.tool_calls is defined and message.tool_calls %}
{{- '[TOOL_CALLS]' ~ message.tool_calls[0].function.name ~ ' ' ~ message.tool_calls[0].id }}
{%- else %}
{{- '<|user|>' ~ message.content }}
{%- endif %}
{%- endfor %}"""
TOOL_CHAT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "abcDEF123",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny, 21 C"},
]


async def start_front(processes: Processes, tmp_path: Path, *flags: str) -> Frontend:
    """A `--router kv` frontend over two mocker workers started with `flags`."""
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    namespace = f"kvu-{uuid.uuid4().hex[:8]}"
    for _ in range(2):
        await processes.worker(
            store_url, "--namespace", namespace, *WORKER_FLAGS, *flags, model=MODEL
        )
    config = FrontendConfig(
        store_url=store_url, port=0, namespaces=(namespace,), router="kv",
        reconcile_interval=1.0, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    front = Frontend(config)
    await front.start()
    await wait_for(lambda: kv_set(front).tokenizer is not None, timeout=30, message="tokenizer")
    return front


@pytest.fixture
async def front(processes: Processes, tmp_path: Path) -> AsyncIterator[Frontend]:
    front = await start_front(processes, tmp_path)
    yield front
    await front.stop()


@pytest.fixture
async def hostile_front(processes: Processes, tmp_path: Path) -> AsyncIterator[Frontend]:
    """The workers publish a chat template of two nested `range(100000)` loops."""
    template = tmp_path / "template.jinja"
    template.write_text(NESTED_LOOPS)
    front = await start_front(processes, tmp_path, "--chat-template", str(template))
    yield front
    await front.stop()


def kv_set(front: Frontend) -> KvSet:
    router = front.router
    assert isinstance(router, KvRouter)
    model = front.registry.models.get(MODEL)
    state = None if model is None else router.tracker.sets.get(model.routable_sets[0].id)
    return state or KvSet(index=None)  # type: ignore[arg-type]


def publish_template(front: Frontend, template: str) -> PromptTokenizer:
    """The set's tokenizer, now with `template` (as a worker would publish it)."""
    state = kv_set(front)
    assert state.tokenizer is not None
    state.tokenizer = PromptTokenizer(state.tokenizer.tokenizer, {"chat_template": template})
    return state.tokenizer


def figures(front: Frontend) -> Any:
    router = front.router
    assert isinstance(router, KvRouter)
    return router.figures


async def test_a_hostile_template_is_disabled_and_never_stops_live(
    hostile_front: Frontend,
) -> None:
    """Counted, not timed: the template's steps run in the tokenizer's thread (on the loop,
    only the inline try's first, refused at its `range`), and the loop goes on turning, so
    answering `/live`, while they run."""
    front = hostile_front
    tokenizer = kv_set(front).tokenizer
    assert tokenizer is not None and tokenizer.renders
    client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
    turns, steps = LoopTurns(), count_steps(tokenizer)
    renders: list[tuple[bool, int, int]] = []  # (on the loop's thread, turns before, after)
    render = tokenizer.env.render

    def counted(*args: Any, **kwargs: Any) -> str:
        before = turns.count
        try:
            return render(*args, **kwargs)
        finally:
            renders.append((threading.get_ident() == turns.loop_thread, before, turns.count))

    tokenizer.env.render = counted  # type: ignore[method-assign]

    loop, ticking = asyncio.get_running_loop(), []

    def tick() -> None:  # (asks for every turn: the loop turns whenever it is free)
        ticking[:] = [loop.call_soon(tick)]

    tick()
    chats = [
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=1
        )
        for i in range(4)
    ]
    answers = await asyncio.gather(*chats)
    in_thread = lambda: [(b, a) for on_loop, b, a in renders if not on_loop]  # noqa: E731
    await wait_for(in_thread, message="the render in the thread ended")
    ticking[0].cancel()
    await turns.stop()
    await steps.stop()
    assert all(a.choices for a in answers)  # routed by prefix
    assert "ran past" in tokenizer.disabled
    assert all(after > before for before, after in in_thread()), renders
    assert steps.on_loop <= len(chats) < steps.off_loop, (steps.on_loop, steps.off_loop)
    async with aiohttp.ClientSession() as session, session.get(f"{front.url}/live") as r:
        assert r.status == 200
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{front.url}/health") as r:
            health = await r.json()
        async with session.get(f"{front.url}/metrics") as r:
            metrics = await r.text()
    reasons = health["routing"]["routed_by_prefix"]
    assert any("ran past" in reason for reason in reasons.values()), health["routing"]
    assert "shoal_frontend_kv_disabled_templates 1.0" in metrics
    assert figures(front).fallbacks >= 4
    assert front.metrics.model(MODEL).in_flight == 0


async def test_a_4mb_chat_is_tokenized_off_the_event_loop(front: Frontend) -> None:
    text = " ".join(VOCAB[i % 40] for i in range(1_000_000))  # ~4 MB
    assert len(text) > 4_000_000
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    tokenizer = kv_set(front).tokenizer
    assert tokenizer is not None
    picks, tokenized = figures(front).picks, count_tokenized(tokenizer)
    rendered = LoopTurns().wrap(tokenizer.env, "render")
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{front.url}/v1/chat/completions", json=body) as r,
    ):
        await r.read()
    await tokenized.stop()
    await rendered.stop()
    assert figures(front).picks == picks + 1  # routed by its KV blocks, not by prefix
    # Counted, not timed: rendered and tokenized in the thread, never on the loop.
    assert rendered.on_loop == 0 and rendered.off_loop == 1
    assert tokenized.on_loop == 0 and tokenized.off_loop > INLINE_NEW, tokenized.off_loop


async def test_tool_messages_reach_the_template_whole(front: Frontend) -> None:
    publish_template(front, MISTRAL_LIKE)
    client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
    before = figures(front).picks
    answer = await client.chat.completions.create(model=MODEL, messages=TOOL_CHAT, max_tokens=1)  # type: ignore[arg-type]
    assert answer.choices
    assert figures(front).picks == before + 1 and figures(front).fallbacks == 0


async def test_a_template_error_routes_that_request_by_prefix(front: Frontend) -> None:
    publish_template(front, "{{ raise_exception('this template refuses every chat') }}")
    client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
    for _ in range(3):
        answer = await client.chat.completions.create(model=MODEL, messages=TOOL_CHAT, max_tokens=1)  # type: ignore[arg-type]
        assert answer.choices
    assert figures(front).fallbacks == 3
    assert front.metrics.model(MODEL).in_flight == 0
    async with aiohttp.ClientSession() as session, session.get(f"{front.url}/metrics") as r:
        metrics = await r.text()
    assert "shoal_frontend_kv_prefix_fallbacks_total 3.0" in metrics
    assert 'shoal_frontend_inflight_requests{model="kv-untrusted"} 0.0' in metrics


def test_the_segment_cache_is_bounded_in_the_bytes_it_really_holds() -> None:
    tokenizer = PromptTokenizer(
        Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": CHAT_TEMPLATE}
    )
    chain = tokenizer.chain
    assert chain is not None
    capacity = chain.capacity = 16 << 20
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(12):  # distinct ~1 MB messages, tokenized and hashed
            text = f"{i} " + " ".join(VOCAB[(i + j) % 40] for j in range(200_000))
            chat = [{"role": "user", "content": text}]
            tokens = tokenizer.chat(chat)
            hashes = tokenizer.chat_hashes(chat, [16], 1 << 20)
            assert tokens is not None and len(tokens) > 200_000
            assert hashes is not None and len(hashes[16]) == len(tokens) // 16
            assert chain.bytes <= capacity
            del text, chat, tokens, hashes
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert chain.bytes > capacity // 2  # (it does keep segments)
    assert held <= capacity * 1.1, f"{held} bytes held for {chain.bytes} counted"


async def test_a_render_that_ignores_its_budget_is_interrupted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokenizer = PromptTokenizer(
        Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": NESTED_LOOPS}
    )
    monkeypatch.setattr(tokenizer.env, "check", lambda: None)  # as if stuck past every check
    job = tokenizer.submit(tokenizer.render, [{"role": "user", "content": "hi"}])
    await wait_for(lambda: tokenizer.rendering, message="rendering")
    KvRouter()._watch(tokenizer)  # what a request that waited too long starts
    with pytest.raises(TemplateOverrun):
        await asyncio.wait_for(asyncio.wrap_future(job), 3 * kv_prompt.RENDER_SECONDS + 5)
    assert not tokenizer.renders and "ran past" in tokenizer.disabled


def test_a_clients_long_chat_is_no_overrun_of_the_template() -> None:
    template = (
        "{% for m in messages %}{{ '<|user|>' ~ (m.content | trim).replace('x', 'y') }}{% endfor %}"
    )
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    text = " ".join(VOCAB[i % 40] for i in range(800_000))  # ~3 MB: three times `MAX_TEXT`
    assert len(text) > 3 * kv_prompt.MAX_TEXT
    tokens = tokenizer.chat([{"role": "user", "content": text}] * 3, wanted=1024)
    assert tokens is not None and len(tokens) == 1024
    assert tokenizer.renders, tokenizer.disabled


async def test_a_router_error_fails_only_its_request_and_leaves_no_gauge_raised(
    front: Frontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("a bug in a routing policy")

    monkeypatch.setattr(front.router, "pick", broken)
    client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model=MODEL, messages=TOOL_CHAT, max_tokens=1)  # type: ignore[arg-type]
    assert front.metrics.model(MODEL).in_flight == 0
    monkeypatch.undo()
    answer = await client.chat.completions.create(model=MODEL, messages=TOOL_CHAT, max_tokens=1)  # type: ignore[arg-type]
    assert answer.choices


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'a' * 1000000000 }}",
        "{{ ('a' * 1000) | replace('', 'b' * 2000) }}",
        "{{ ('a' * 1000).replace('a', 'b' * 2000) }}",
        "{{ ('\\n' * 100000) | indent(1000) }}",
        "{{ '%0999999999d' % 1 }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}"
        "{% endfor %}",
        "{% set x = 'a' * 100000 %}{% for a in x %}{% for b in x %}{% endfor %}{% endfor %}",
    ],
)
def test_a_template_that_builds_without_bound_is_stopped_and_disabled(template: str) -> None:
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    t0 = time.monotonic()
    with pytest.raises(TemplateOverrun):
        tokenizer.chat([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 3 * kv_prompt.RENDER_SECONDS
    assert not tokenizer.renders and tokenizer.disabled


def peak_while_rendering(template: str) -> int:
    """The template's render (in the thread's budgets) refused; the most memory it held."""
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    tracemalloc.start()
    try:
        with pytest.raises(TemplateOverrun):
            tokenizer.chat([{"role": "user", "content": "hi"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not tokenizer.renders and tokenizer.disabled
    return peak


@pytest.mark.parametrize(
    "build", ["[s] * 100", "100 * [s]", "[[s] * 10] * 10", "([s] * 16) + ([s] * 16)"]
)
@pytest.mark.parametrize(
    "use", ["{{ x }}", "{{ x | join }}", "{{ ''.join(x) }}", "{{ x | tojson }}", "{{ '%s' % x }}"]
)
def test_a_list_of_long_strings_repeated_is_refused_before_it_is_built(
    build: str, use: str
) -> None:
    # `[s] * 100` is 100 items (under the limit) holding 6 MB: printed, joined or encoded
    # whole by C, in one operation no check runs inside, had it been allowed.
    template = "{% set s = 'a' * 60000 %}{% set x = " + build + " %}" + use
    peak = peak_while_rendering(template)
    assert peak < kv_prompt.MAX_TEXT, f"{peak} bytes built before the template was refused"


@pytest.mark.parametrize(
    "template",
    [
        "{{ '%*s' % (5000000, 'x') }}",
        "{{ '%-*s|' % (5000000, 'x') }}",
        "{{ '%.*f' % (5000000, 1.5) }}",
        "{{ '%%%*s' % (5000000, 'x') }}",
        "{{ '{0:{1}}'.format('x', '5000000') }}",
        "{{ '{:>{}}'.format('x', '5000000') }}",
        "{{ '{0[0]:>{0[1]}}'.format(['x', 5000000]) }}",
        "{{ '{x:{w}}'.format_map({'x': 'x', 'w': 5000000}) }}",
        "{{ '{0:{1}}'['format']('x', '5000000') }}",
    ],
)
def test_a_format_width_from_the_arguments_is_refused_before_it_is_built(template: str) -> None:
    peak = peak_while_rendering(template)
    assert peak < kv_prompt.MAX_TEXT, f"{peak} bytes built before the template was refused"


def test_formats_of_a_foreseeable_width_still_render() -> None:
    template = "{{ '%5s|%-3d|%%*|%.2f' % ('ab', 7, 1.5) }}{{ '{0:>4}{1:03d}'.format('x', 1) }}"
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    assert tokenizer.render([{"role": "user", "content": "hi"}]) == "   ab|7  |%*|1.50   x001"


def test_a_system_message_put_before_a_long_chat_of_short_messages_still_renders() -> None:
    """`[system] + messages` builds no text: it is held to the text its items hold, as the
    render's limit counts a chat's, not to their keys and items too (a chat of 40,000 short
    messages was refused, and its template disabled for the model)."""
    template = (
        "{% set msgs = [{'role': 'system', 'content': 'Be brief.'}] + messages %}"
        "{% for m in msgs %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    )
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    chat = [{"role": "user" if i % 2 else "assistant", "content": "ok"} for i in range(40_000)]
    assert tokenizer.render(chat).startswith("<|system|>Be brief.\n<|assistant|>ok\n")
    assert not tokenizer.disabled


HERMES_LIKE = (
    "{%- for m in messages %}<|user|>{{ m.content }}"
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}"
    '{{- \'<tool_call>{"name": "\' ~ tc.function.name ~ \'", "arguments": \' ~ '
    "tc.function.arguments ~ '}</tool_call>' }}"
    "{%- endfor %}{%- endif %}{%- endfor %}<|assistant|>"
)
QWEN_LIKE = HERMES_LIKE.replace("~ tc.function.arguments ~", "~ (tc.function.arguments|tojson) ~")


def tool_chat(arguments: str) -> list[dict[str, Any]]:
    """A chat whose assistant called a tool with `arguments`."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "write", "arguments": arguments},
    }
    return [
        {"role": "user", "content": "write the file"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]


@pytest.mark.parametrize("template", [HERMES_LIKE, QWEN_LIKE], ids=["concat", "tojson"])
def test_one_clients_long_tool_call_arguments_never_disable_the_template(template: str) -> None:
    """A message's text was counted as its strings, 64 characters for anything else: 1.5 MB
    of tool-call arguments (legal input) printed by a Hermes/Qwen-like template overran the
    render's limit and disabled the template for every client. Now the limit counts the
    chat's nested strings, and the chat renders."""
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    arguments = '{"path": "a.py", "text": "' + "print(1)\\n" * 150_000 + '"}'
    assert len(arguments) > 1.4 * kv_prompt.MAX_TEXT
    text = tokenizer.render(tool_chat(arguments))
    assert text.startswith('<|user|>write the file<|user|><tool_call>{"name": "write"')
    assert len(text) == kv_prompt.MAX_TEXT  # (what a render keeps)
    hashes = tokenizer.chat_hashes(tool_chat(arguments), [16], 1024)
    assert hashes is not None and len(hashes[16]) == 1024
    assert tokenizer.renders, tokenizer.disabled
    assert tokenizer.chat_hashes(tool_chat("{}"), [16], 8) is not None


async def test_a_clients_long_tool_call_keeps_kv_routing_on_for_everyone(front: Frontend) -> None:
    """The same through a frontend: a 1.5 MB tool call (the official client) is answered,
    and the next client's chat is still routed by its KV blocks, not by prefix."""
    tokenizer = publish_template(front, QWEN_LIKE)
    client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
    arguments = '{"text": "' + "print(1)\\n" * 150_000 + '"}'
    chat: Any = tool_chat(arguments)
    long = await client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1)
    assert long.choices and tokenizer.renders, tokenizer.disabled
    picks = figures(front).picks
    answer = await client.chat.completions.create(model=MODEL, messages=TOOL_CHAT, max_tokens=1)  # type: ignore[arg-type]
    assert answer.choices and figures(front).picks == picks + 1
    async with aiohttp.ClientSession() as session, session.get(f"{front.url}/health") as r:
        assert not (await r.json())["routing"].get("routed_by_prefix"), "a template disabled"


def test_an_overrun_a_long_chat_may_explain_fails_that_chat_only() -> None:
    """An overrun disabled the template whatever the chat: one client's long chat turned
    KV routing off for the model for good. Now an overrun on a chat over `SMALL_CHAT` fails
    that request (routed by prefix); the same template overrunning on a small chat is
    disabled."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ 'a' * 100000000 }}"
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    long_chat = tool_chat("x" * (kv_prompt.SMALL_CHAT + 1))
    for _ in range(2):
        with pytest.raises(TemplateOverrun):
            tokenizer.chat(long_chat)
        assert tokenizer.renders, tokenizer.disabled
    with pytest.raises(TemplateOverrun):
        tokenizer.chat(tool_chat("{}"))
    assert not tokenizer.renders and "would build" in tokenizer.disabled


@pytest.mark.parametrize(
    ("template", "name"),
    [
        ("{{ ('a ' * 500000) | wordcount }}", "wordcount"),
        ("{{ ('a ' * 500000) | wordwrap(10) }}", "wordwrap"),
        ("{{ ('a ' * 500000) | title }}", "title"),
        ("{{ ([0] * 200000) | tojson }}", "tojson"),
        ("{{ ([0] * 200000) | sort | first }}", "sort"),
        ("{{ ([0] * 200000) | join }}", "join"),
        ("{{ ([0] * 200000) | string }}", "string"),
        ("{% set n = ((2 ** 64) ** 64) ** 2 %}{{ ([n] * 100) | string }}", "string"),
        ("{{ range(200000) | list | unique | list | length }}", "unique"),
        ("{{ [0] * 200000 }}", None),
        ("{{ 'x' ~ [0] * 200000 }}", None),
        ("{{ '%s' % ([0] * 200000,) }}", None),
        ("{{ ([0] * 200000) is lower }}", None),
    ],
)
def test_a_slow_operation_on_a_million_characters_or_items_is_refused_before_it_runs(
    template: str, name: str | None
) -> None:
    """A template built a value within its limit (~1M characters or items) and gave it to
    one C-level operation (`wordcount`, `wordwrap`, `tojson` of a list, `sort`, printing a
    list): the call ran to its end holding the GIL, so the frontend's event loop, 60-190 ms
    a request, and the time budget, checked between calls, never saw it. Now an operation
    not known quick is given nothing over `OP_BOUND`: refused before it runs, and the
    template (overrunning on a small chat) is disabled."""
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    given: list[int] = []
    if name is not None:
        real = tokenizer.env.filters[name].__wrapped__  # type: ignore[attr-defined]

        def spy(*args: Any, **kwargs: Any) -> Any:
            given.extend(len(a) for a in args if isinstance(a, str | list | tuple))
            return real(*args, **kwargs)

        spy.__name__ = f"do_{name}"
        tokenizer.env.filters[name] = tokenizer.env._bounded_filter(spy)
    with pytest.raises(TemplateOverrun):
        tokenizer.chat([{"role": "user", "content": "hi"}])
    assert not tokenizer.renders and tokenizer.disabled
    assert all(size <= kv_prompt.OP_BOUND for size in given), given


def test_quick_operations_on_a_clients_long_message_still_render() -> None:
    """What real templates do to a message (`trim`, `split`, `replace`, `tojson` of a
    string, `~`, tests) is linear C: a client's long message is given to them whole."""
    template = (
        "{% for m in messages %}{% if m.content is string and m.content is not none %}"
        "{{ '<|user|>' ~ (m.content | trim).split('</think>')[-1].replace('x', 'y') }}"
        "{{ m.content | tojson | length }}{% endif %}{% endfor %}"
    )
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    text = " ".join(VOCAB[i % 40] for i in range(200_000))
    assert len(text) > 10 * kv_prompt.OP_BOUND
    assert tokenizer.render([{"role": "user", "content": text}]).startswith("<|user|>")
    assert tokenizer.renders, tokenizer.disabled


@pytest.mark.parametrize(
    "template",
    [
        "{% set a = ((10 ** 60) ** 60) ** 60 %}{% set b = a ** 8 %}{{ 'x' }}",
        "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
        "{% endfor %}",
        "{% set x = ('f' * 100000) | int(base=16) %}{{ x // (x - 1) }}",
        "{% set x = ('f' * 100000) | int(base=16) %}{{ '%x' % x }}",
        "{% set ns = namespace() %}{% set ns.x = ((2 ** 64) ** 64) ** 7 %}"
        "{% for i in range(10000) %}{% set ns.x = ns.x + ns.x %}{% endfor %}",
    ],
)
def test_integer_arithmetic_past_a_bound_is_refused_before_it_runs(template: str) -> None:
    """`a ** 8` of `a = ((10 ** 60) ** 60) ** 60` is one C multiplication of ~1 s, holding
    the GIL (so the frontend's event loop, whichever thread renders): sequences were held to
    a size, integers were not. Now no operation is given or makes an integer over
    `INT_BITS`: refused before it runs (counted by the arithmetic's operands and results),
    and the template, overrunning on a small chat, is disabled."""
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    widest: list[int] = []

    def spied(real: Any) -> Any:
        def spy(left: Any, right: Any) -> Any:
            widest.extend(v.bit_length() for v in (left, right) if isinstance(v, int))
            result = real(left, right)
            widest.extend([result.bit_length()] if isinstance(result, int) else [])
            return result

        return spy

    env = tokenizer.env
    env.binop_table = {op: spied(fn) for op, fn in env.binop_table.items()}
    with pytest.raises(TemplateOverrun, match="integer"):
        tokenizer.chat([{"role": "user", "content": "hi"}])
    assert not tokenizer.renders and "integer" in tokenizer.disabled
    assert max(widest, default=0) <= INT_BITS, max(widest)


def test_a_templates_ordinary_arithmetic_still_renders() -> None:
    """What real templates compute (parities, lengths less one, small powers) is well within
    `INT_BITS`, `-`, `//` and `/` now checked too."""
    template = (
        "{% for m in messages %}{{ loop.index0 % 2 }}{{ messages | length - 1 }}"
        "{{ (loop.index * 3) // 2 }}{{ 10 / 4 }}{{ 2 ** 64 }}|{{ [7 ** 40, 1] | tojson }}"
        "{% endfor %}"
    )
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    text = tokenizer.render([{"role": "user", "content": "hi"}])
    assert text == f"0012.5{2**64}|[{7**40}, 1]"
    assert tokenizer.renders, tokenizer.disabled


def test_strings_joined_with_plus_are_held_to_the_limit() -> None:
    """`+` of two strings (the sandbox's quick path for it) is refused past the render's
    limit, as every other way of building a string is, and the template is disabled."""
    template = (
        "{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}"
        "{% endfor %}{{ ns.x | length }}"
    )
    tokenizer = PromptTokenizer(Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template})
    with pytest.raises(TemplateOverrun, match="too large"):
        tokenizer.render([{"role": "user", "content": "hi"}])
    assert not tokenizer.renders


@pytest.mark.parametrize(
    "template",
    [
        "{{ ('a' * 60000).translate({97: 'b' * 20000}) | length }}",
        "{{ ('a' * 60000) | attr('translate') }}",  # (read, not called: nothing built)
        "{{ ('ab' * 30000).translate({97: 'c' * 9000, 98: 'd' * 9000}) }}",
    ],
)
def test_a_translation_that_would_build_without_bound_is_refused_before_it_runs(
    template: str,
) -> None:
    """`str.translate` built its whole text in one C call before its size was checked:
    60,000 characters each made 20,000 long held the GIL, so the event loop, 1.5 s for
    1.2 G characters (65,536 of 65,536: out of memory)."""
    if "attr(" in template:  # (control: reading the method is no build)
        tokenizer = PromptTokenizer(
            Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": template}
        )
        assert tokenizer.chat([{"role": "user", "content": "hi"}]) is not None
        return
    peak = peak_while_rendering(template)
    assert peak < kv_prompt.MAX_TEXT, f"{peak} bytes built before the template was refused"
