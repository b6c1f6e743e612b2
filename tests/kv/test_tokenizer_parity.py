"""The frontend tokenizes a prompt exactly as the mocker does: it loads the mocker's
published `tokenizer.json` and chat template, and the mocker's own KV events (which carry
the token ids it computed) cover every block of the frontend's tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq.asyncio

from shoal.frontend.kv.index import KvIndex
from shoal.frontend.kv.prompt import PromptTokenizer
from shoal.frontend.kv.router import KvPrompt
from shoal.frontend.proxy.fields import decode_fields
from shoal.kv import KVEventBatch, token_block_hashes
from shoal.kv.subscription import KvStats, KvSubscription
from shoal.worker.engines.mocker import MockerEngine
from tests.helpers import Server, wait_for
from tests.worker.engines.support import client_for, engine_served

BS = 4
LONG = "The quick brown fox, named Zorblax_42, jumps over the lazy dog! " * 12


@pytest.fixture
async def mocker() -> AsyncIterator[tuple[MockerEngine, Server, KvIndex]]:
    engine = MockerEngine("parity", ttft_ms=0, itl_ms=0, block_size=BS, kv_events_port=0)
    async with engine_served(engine) as (engine, server):
        assert engine.kv_events is not None
        ctx = zmq.asyncio.Context()
        index = KvIndex(BS)

        def apply(seq: int, batch: KVEventBatch) -> None:
            for event in batch.events:
                index.apply(1, event)

        sub = KvSubscription(ctx, 1, engine.kv_events, apply, lambda: index.purge(1), KvStats())
        sub.start()
        yield engine, server, index
        await sub.stop()
        ctx.term()


def frontend_tokens(engine: MockerEngine, body: dict[str, Any]) -> list[int]:
    """What the frontend computes for `body`: its fields, decoded as the proxy decodes them,
    tokenized with the files the mocker publishes."""
    assert engine._dir is not None
    base = engine._dir / "base"
    tokenizer = PromptTokenizer.load(base / "tokenizer.json", base / "tokenizer_config.json")
    prompt = KvPrompt.of(decode_fields(msgspec.json.encode(body), with_prompt=True))
    tokens = prompt.tokens(tokenizer)
    assert tokens is not None
    return tokens


def cached_blocks(index: KvIndex, tokens: list[int]) -> int:
    return index.overlaps(token_block_hashes(tokens, BS)).get(1, 0)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": LONG}],
        [
            {"role": "system", "content": "You are terse.\nAnswer in one line."},
            {"role": "user", "content": [{"type": "text", "text": LONG}]},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "And then? (Ünïcode too)"},
        ],
    ],
    ids=["one-message", "multi-turn-with-parts"],
)
async def test_chat_tokens_match_the_mockers(
    mocker: tuple[MockerEngine, Server, KvIndex], messages: list[dict[str, Any]]
) -> None:
    engine, server, index = mocker
    body = {"model": "parity", "messages": messages, "max_tokens": 1}
    tokens = frontend_tokens(engine, body)
    answer = await client_for(server).chat.completions.create(**body)  # type: ignore[call-overload]
    assert answer.usage.prompt_tokens == len(tokens)
    blocks = len(tokens) // BS
    assert blocks > 10
    await wait_for(lambda: cached_blocks(index, tokens) == blocks, message="every block matched")


@pytest.mark.parametrize("prompt", [LONG, [LONG], list(range(3, 60))], ids=["text", "list", "ids"])
async def test_completion_tokens_match_the_mockers(
    mocker: tuple[MockerEngine, Server, KvIndex], prompt: Any
) -> None:
    engine, server, index = mocker
    body = {"model": "parity", "prompt": prompt, "max_tokens": 1}
    tokens = frontend_tokens(engine, body)
    answer = await client_for(server).completions.create(**body)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(tokens)
    blocks = len(tokens) // BS
    await wait_for(lambda: cached_blocks(index, tokens) == blocks, message="every block matched")


async def test_a_growing_chats_hashes_from_kept_segments_match_the_mockers_blocks(
    mocker: tuple[MockerEngine, Server, KvIndex],
) -> None:
    """Turn after turn, the frontend hashes a chat from the segments it kept from the turns
    before (tokenizing only the new text), and the mocker's own events hold every block."""
    engine, server, index = mocker
    assert engine._dir is not None
    base = engine._dir / "base"
    tokenizer = PromptTokenizer.load(base / "tokenizer.json", base / "tokenizer_config.json")
    assert tokenizer.chain is not None
    chat: list[dict[str, Any]] = [{"role": "system", "content": "Be brief. " + LONG}]
    for turn in range(4):
        chat += [{"role": "user", "content": f"Question {turn}: (Ünï) {LONG[: 40 * turn + 7]}"}]
        body = {"model": "parity", "messages": chat, "max_tokens": 1}
        prompt = KvPrompt.of(decode_fields(msgspec.json.encode(body), with_prompt=True))
        kept = len(tokenizer.chain)
        prompt.prepare(tokenizer, [BS], 1024)
        if turn:  # the earlier turns' segments were found, only the new ones added
            assert len(tokenizer.chain) - kept <= 3
        hashes = prompt.hashes[(tokenizer, BS)]
        answer = await client_for(server).chat.completions.create(**body)  # type: ignore[call-overload]
        assert answer.usage.prompt_tokens // BS == len(hashes)
        await wait_for(
            lambda h=hashes: index.overlaps(h).get(1, 0) == len(h),  # type: ignore[misc]
            message=f"every block of turn {turn} matched",
        )
        chat += [{"role": "assistant", "content": answer.choices[0].message.content or ""}]
