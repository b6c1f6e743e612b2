"""`KvSubscription` against a publisher speaking vLLM's format: catching up on connect,
replaying a gap, and resnapshotting when a gap cannot be replayed."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq.asyncio

from shoal.frontend.kv.index import KvIndex
from shoal.kv import KvEndpoint, token_block_hashes
from shoal.kv.subscription import KvStats, KvSubscription
from tests.helpers import wait_for
from tests.kv import vllm_fixtures as vllm
from tests.kv.fake_vllm import FakeVllmPublisher

BS = 2
PROMPT = list(range(1, 21))  # 10 blocks


def stored_block(i: int) -> bytes:
    """A batch storing block i of PROMPT (engine hash 100 + i, chained to block i - 1)."""
    parent = None if i == 0 else 100 + i - 1
    return vllm.batch(vllm.stored([100 + i], parent, PROMPT[i * BS : (i + 1) * BS], BS))


@pytest.fixture
async def publisher() -> AsyncIterator[FakeVllmPublisher]:
    fake = FakeVllmPublisher()
    yield fake
    await fake.close()


@pytest.fixture
async def subscribe(publisher: FakeVllmPublisher) -> AsyncIterator[tuple[KvIndex, KvStats]]:
    ctx = zmq.asyncio.Context()
    index, stats = KvIndex(BS), KvStats()

    def apply(seq: int, batch: object) -> None:
        for event in batch.events:  # type: ignore[attr-defined]
            index.apply(7, event)

    endpoint = KvEndpoint(publisher=publisher.endpoint, replay=publisher.replay_endpoint)
    sub = KvSubscription(ctx, 7, endpoint, apply, lambda: index.purge(7), stats)
    for seq in range(2):  # published before the frontend subscribed
        await publisher.send(seq, stored_block(seq), live=False)
    sub.start()
    await publisher.subscribed()  # (what is sent live before it would not reach the subscriber)
    yield index, stats
    await sub.stop()
    ctx.term()


def cached(index: KvIndex) -> int:
    return index.overlaps(token_block_hashes(PROMPT, BS)).get(7, 0)


async def test_a_new_subscriber_replays_what_was_published_before_it(
    subscribe: tuple[KvIndex, KvStats],
) -> None:
    index, stats = subscribe
    await wait_for(lambda: cached(index) == 2, message="blocks 0-1 replayed on connect")
    assert stats.resnapshots == 0


async def test_a_gap_in_sequence_numbers_is_replayed(
    publisher: FakeVllmPublisher, subscribe: tuple[KvIndex, KvStats]
) -> None:
    index, stats = subscribe
    await wait_for(lambda: cached(index) == 2, message="caught up")
    await publisher.send(2, stored_block(2), live=False)  # lost on the way, still buffered
    await publisher.send(3, stored_block(3))
    await wait_for(lambda: cached(index) == 4, message="the gap (batch 2) filled by a replay")
    assert 2 in publisher.replay_requests
    assert stats.resnapshots == 0


async def test_a_gap_that_cannot_be_replayed_drops_the_instances_blocks(
    publisher: FakeVllmPublisher, subscribe: tuple[KvIndex, KvStats]
) -> None:
    index, stats = subscribe
    await wait_for(lambda: cached(index) == 2, message="caught up")
    await publisher.send(2, vllm.batch(vllm.removed([101])), live=False, keep=False)  # gone
    await publisher.send(3, vllm.batch(vllm.stored([500], None, [50, 51], BS)))
    await wait_for(lambda: stats.resnapshots == 1, message="a resnapshot")
    # Block 1 may have been evicted by the lost batch: nothing of the old state is trusted,
    # and what came after the gap is indexed.
    assert cached(index) == 0
    assert index.overlaps(token_block_hashes([50, 51], BS)) == {7: 1}


async def test_a_restarted_publisher_is_resnapshotted_not_ignored(
    publisher: FakeVllmPublisher, subscribe: tuple[KvIndex, KvStats]
) -> None:
    index, stats = subscribe
    await wait_for(lambda: cached(index) == 2, message="caught up (batches 0-1)")
    # vLLM restarts: empty cache, numbering from 0 again, a new replay buffer.
    publisher.kept.clear()
    await publisher.send(0, vllm.batch(vllm.stored([900], None, [70, 71], BS)))
    await wait_for(lambda: stats.resnapshots == 1, message="the restart noticed")
    await wait_for(
        lambda: index.overlaps(token_block_hashes([70, 71], BS)) == {7: 1}, message="new blocks"
    )
    assert cached(index) == 0  # the old cache's blocks are gone


def tagged(*events: dict[str, object]) -> bytes:
    """A batch of events in the tagged-map form newer vLLMs publish (and vllm-router reads)."""
    return msgspec.msgpack.encode([1_700_000_000.5, list(events), 0])


def stored_map(i: int) -> dict[str, object]:
    return {
        "type": "BlockStored", "block_hashes": [100 + i],
        "parent_block_hash": None if i == 0 else 100 + i - 1,
        "token_ids": PROMPT[i * BS : (i + 1) * BS], "block_size": BS, "lora_id": None,
        "medium": "GPU", "lora_name": None, "group_idx": 0,
    }  # fmt: skip


async def test_events_in_the_tagged_map_form_are_indexed_as_the_array_form_is(
    publisher: FakeVllmPublisher, subscribe: tuple[KvIndex, KvStats]
) -> None:
    index, stats = subscribe
    await wait_for(lambda: cached(index) == 2, message="blocks 0-1 (array form) replayed")
    await publisher.send(2, tagged(stored_map(2), stored_map(3)))
    await wait_for(lambda: cached(index) == 4, message="blocks 2-3 (map form) indexed")
    await publisher.send(
        3, tagged({"type": "BlockRemoved", "block_hashes": [102], "medium": "GPU"})
    )
    await wait_for(lambda: cached(index) == 2, message="block 2's eviction (map form) applied")
    assert stats.decode_errors == 0 and stats.resnapshots == 0
