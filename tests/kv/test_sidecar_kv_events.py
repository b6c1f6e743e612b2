"""A `shoal worker --engine openai` in front of a vLLM server advertises that server's KV
event sockets in its discovery record, and a frontend's tracker indexes the events (checked
against a fake publisher speaking vLLM's format)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shoal.discovery import Discovery, Query
from shoal.frontend.kv.tracker import KvTracker
from shoal.frontend.registry.registry import Registry
from shoal.kv import KvEndpoint, token_block_hashes
from shoal.store import open_store
from tests.helpers import wait_for
from tests.kv import vllm_fixtures as vllm
from tests.kv.fake_vllm import FakeVllmPublisher
from tests.processes import Processes
from tests.worker.engines.fake_upstream import MODEL, FakeUpstream

TOKENS = list(range(64))


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream()
    await fake.server.start()
    yield fake
    await fake.server.stop()


@pytest.fixture
async def publisher() -> AsyncIterator[FakeVllmPublisher]:
    fake = FakeVllmPublisher()
    yield fake
    await fake.close()


async def test_a_sidecar_advertises_the_fronted_vllms_kv_events(
    processes: Processes, tmp_path: Path, upstream: FakeUpstream, publisher: FakeVllmPublisher
) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    worker = await processes.worker(
        store_url, "--upstream", upstream.server.url,
        "--kv-events-endpoint", publisher.endpoint,
        "--kv-replay-endpoint", publisher.replay_endpoint,
        model=MODEL, engine="openai",
    )  # fmt: skip
    store = await open_store(store_url)
    try:
        models = [
            m
            for m in await Discovery(store).list(Query(namespace="default"))
            if m.instance_id == worker.instance_id and m.card.lora is None
        ]
    finally:
        await store.close()
    assert len(models) == 1
    assert models[0].instance.kv_events == KvEndpoint(
        publisher=publisher.endpoint, replay=publisher.replay_endpoint
    )

    # The frontend side: the registry tells the tracker, which follows the advertised stream.
    registry, tracker = Registry(), KvTracker()
    registry.observers.append(tracker)
    ws = registry.join(models[0])
    block_size = models[0].card.kv_block_size
    hashes = token_block_hashes(TOKENS, block_size)
    try:
        await publisher.send(
            0, vllm.batch(vllm.stored([1, 2], None, TOKENS[: 2 * block_size], block_size))
        )
        held = lambda: tracker.sets[ws.id].index.overlaps(hashes)  # noqa: E731
        await wait_for(
            lambda: held() == {worker.instance_id: 2}, message="the fake's blocks indexed"
        )
        registry.leave(models[0].key)
        assert ws.id not in tracker.sets  # the set is gone, and with it the instance's blocks
    finally:
        await tracker.close()
        registry.close()
