"""The `kv` policy: cheapest instance by uncached blocks and load, never a tainted or
inhibited one, and the prefix policy (with one log line) for a model without a tokenizer."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
from tokenizers import Tokenizer

from shoal.cards import ModelCard
from shoal.discovery import EndpointId, InstanceInfo, ModelInstance, ModelKey
from shoal.frontend.kv.prompt import PromptTokenizer
from shoal.frontend.kv.router import KvPrompt, KvRouter
from shoal.frontend.proxy.fields import decode_fields
from shoal.frontend.registry.registry import Registry, WorkerSet
from shoal.kv import BlockStored
from shoal.worker.engines.mocker.tokenizer import CHAT_TEMPLATE, TOKENIZER

CARD = ModelCard.build(
    display_name="m", slug="m", source="test/m", model_types=["chat"], context_length=4096,
    kv_block_size=4,
)  # fmt: skip
TEXT = " ".join(["the", "of", "and", "to", "in", "is", "that", "it"] * 20)


def member(instance_id: int) -> ModelInstance:
    endpoint = EndpointId("ns", "backend", "generate")
    url = f"http://127.0.0.1:{9000 + instance_id}"
    info = InstanceInfo("ns", "backend", "generate", instance_id, url, url)
    return ModelInstance(ModelKey(endpoint, instance_id), CARD, info)


def prompt(text: str = TEXT) -> KvPrompt:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return KvPrompt.of(decode_fields(msgspec.json.encode(body), with_prompt=True))


@pytest.fixture
def fleet() -> tuple[KvRouter, WorkerSet]:
    router, registry = KvRouter(), Registry()
    registry.observers.append(router.tracker)
    ws = registry.join(member(1))
    for i in (2, 3):
        registry.join(member(i))
    return router, ws


def with_tokenizer(router: KvRouter, ws: WorkerSet) -> PromptTokenizer:
    tokenizer = PromptTokenizer(
        Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": CHAT_TEMPLATE}
    )
    router.tracker.sets[ws.id].tokenizer = tokenizer
    return tokenizer


def cache(
    router: KvRouter, ws: WorkerSet, instance_id: int, tokens: list[int], blocks: int
) -> None:
    router.tracker.sets[ws.id].index.apply(
        instance_id,
        BlockStored(
            block_hashes=list(range(1000 * instance_id, 1000 * instance_id + blocks)),
            parent_block_hash=None, token_ids=tokens[: 4 * blocks], block_size=4,
        ),
    )  # fmt: skip


def test_the_instance_holding_most_of_the_prompt_wins_unless_too_loaded(
    fleet: tuple[KvRouter, WorkerSet],
) -> None:
    router, ws = fleet
    tokenizer = with_tokenizer(router, ws)
    tokens = prompt().tokens(tokenizer)
    assert tokens is not None and len(tokens) // 4 > 30
    cache(router, ws, 2, tokens, 30)
    cache(router, ws, 3, tokens, 10)
    by_id = {u.instance_id: u for u in ws.routable}

    def prepared() -> KvPrompt:
        p = prompt()
        p.prepare(
            tokenizer, {4}, router.max_blocks
        )  # (a request does it in the tokenizer's thread)
        return p

    assert router.pick(ws, prepared()).instance_id == 2  # type: ignore[union-attr]
    by_id[2].in_flight = 1000  # far too loaded: the next best holder
    assert router.pick(ws, prepared()).instance_id == 3  # type: ignore[union-attr]
    by_id[3].inhibited_until = time.monotonic() + 60  # never an inhibited one
    assert router.pick(ws, prepared()).instance_id == 1  # type: ignore[union-attr]
    assert router.figures.picks == 3


def test_a_model_without_a_tokenizer_is_routed_by_prefix_with_one_log_line(
    fleet: tuple[KvRouter, WorkerSet], caplog: pytest.LogCaptureFixture
) -> None:
    router, ws = fleet
    assert router.tracker.sets[ws.id].no_tokenizer == "its metadata has no tokenizer.json"
    caplog.set_level(logging.INFO, logger="shoal.frontend.kv.router")
    first = router.pick(ws, prompt())
    assert router.pick(ws, prompt()) is first  # the prefix policy remembers where it went
    assert router.pick(ws, prompt("something else entirely")) is not None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "routed by prefix" in lines[0] and "no tokenizer.json" in lines[0]
    assert router.figures.picks == 0
