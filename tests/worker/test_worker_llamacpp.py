"""A real `shoal worker --engine llamacpp` process serving SmolLM2-135M, used with the openai client."""

from __future__ import annotations

import openai
import pytest

from shoal.discovery import Discovery
from shoal.store import Store
from tests.worker.conftest import StartWorker

pytestmark = pytest.mark.llamacpp


async def test_llamacpp_worker_serves_smollm2_to_the_openai_client_and_registers_it(
    start_worker: StartWorker, store: Store
) -> None:
    pytest.importorskip("llama_cpp", reason="needs the llamacpp extra (scripts/ensure-llamacpp.sh)")
    worker = await start_worker(engine="llamacpp", model="SmolLM2-135M-Instruct", timeout=60)
    client = openai.AsyncOpenAI(base_url=worker.url + "/v1", api_key="unused")
    reply = await client.chat.completions.create(
        model=worker.model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 8
    chunks = [
        c.choices[0].delta.content or ""
        async for c in await client.chat.completions.create(
            model=worker.model,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        if c.choices
    ]
    assert "".join(chunks) == reply.choices[0].message.content
    models = await Discovery(store).list()
    assert [(m.card.display_name, m.instance_id) for m in models] == [
        ("SmolLM2-135M-Instruct", worker.instance_id)
    ]
    assert {"config.json", "tokenizer_config.json"} <= set(models[0].card.metadata_files)
    await client.close()
