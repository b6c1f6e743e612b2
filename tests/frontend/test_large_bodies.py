"""Large request bodies: their nesting judged as they arrive, their messages decoded when read.

A body past `METER_FROM` is judged a piece at a time as the socket delivers it (no pass over
the whole body on the event loop), and one past `RAW_MESSAGES_FROM` keeps its messages as
JSON text for prefix-aware routing: the answers are the same as for small bodies."""

from __future__ import annotations

import json

import aiohttp
import pytest

from shoal.frontend.http import server
from shoal.frontend.proxy import fields
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.test_proxy import assert_refused_too_deep, ready


def chat(messages: int) -> list[dict[str, str]]:
    """A chat of `messages` turns whose text holds quotes, escapes and brackets."""
    text = 'see "this" \\ path [x] {y}\nthen more words to fill the turn ' * 3
    return [
        {"role": "user" if i % 2 else "assistant", "content": f"{i}: {text}"}
        for i in range(messages)
    ]


@pytest.mark.parametrize("router", ["round-robin", "prefix"])
@pytest.mark.parametrize("deep_at", ["start", "end"])
async def test_a_large_body_nested_past_the_bound_is_400_wherever_the_depth_is(
    start_worker: StartWorker, start_frontend: StartFrontend, router: str, deep_at: str
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker, router=router)
    deep = '{"a":' * 80 + "1" + "}" * 80
    pad = json.dumps(chat(3_000))
    assert len(pad) > server.METER_FROM
    members = [f'"metadata":{deep}', f'"messages":{pad}']
    if deep_at == "end":
        members.reverse()
    body = ('{"model":"mock-llm",' + ",".join(members) + "}").encode()
    await assert_refused_too_deep(frontend, worker, body)


@pytest.mark.parametrize("router", ["round-robin", "prefix", "kv"])
async def test_a_large_chat_at_the_bound_is_forwarded_byte_for_byte(
    start_worker: StartWorker, start_frontend: StartFrontend, router: str
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker, router=router)
    nested: object = 1
    for _ in range(62):  # (with the body's object and `metadata`'s: 64 levels)
        nested = {"a": nested}
    body = json.dumps(
        {"model": "mock-llm", "metadata": nested, "messages": chat(3_000), "max_tokens": 2}
    ).encode()
    assert fields.RAW_MESSAGES_FROM < len(body) < 1 << 20
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{frontend.url}/v1/chat/completions", data=body)
        assert response.status == 200, await response.text()
        assert (await response.json())["object"] == "chat.completion"
    assert worker.bodies == [body]


def test_a_large_bodys_messages_are_read_as_the_small_bodys_are() -> None:
    messages = chat(3_000)
    body = json.dumps({"model": "m", "messages": messages}).encode()
    assert len(body) > fields.RAW_MESSAGES_FROM
    large = fields.decode_fields(body, with_prompt=True, too_deep=False)
    small = fields._decode_prompt_fields(body)  # (as a small body's: every message decoded)
    assert isinstance(large, fields.LargePromptFields)
    assert not isinstance(small, fields.LargePromptFields)
    assert fields.prompt_text(large) == fields.prompt_text(small) != ""
    assert large.model == "m" and large.messages is not None and len(large.messages) == 3_000
