"""What `KvStreamReader` holds once its batches are applied: nothing of them. A batch of more
than `APPLY_SLICE` blocks (a long prompt's prefill) is kept for the instance's flush task,
and the ledger's order of kept batches holds its entry until the next trim or compaction."""

from __future__ import annotations

import gc
import tracemalloc

from shoal.frontend.kv.stream import KvStreamReader
from shoal.kv import BlockStored, KVEventBatch, encode_batch
from shoal.kv import stream as layout
from shoal.kv.subscription import APPLY_SLICE
from tests.helpers import wait_for

NS, INSTANCE = "ns", 0xAB


async def test_batches_applied_by_the_flush_task_are_not_held_after() -> None:
    """Each batch taken by the flush task stayed referenced, payload and decoded events, from
    the ledger's order until 1,024 more such entries piled up: 1,024 batches of a 2,000-block
    prefill (~1.5 MB decoded each) were ~1.5 GB held by a frontend whose bound on kept
    batches is 64 MiB. A batch applied is now let go of."""
    reader = KvStreamReader("nats://127.0.0.1:1")
    applied: list[float] = []
    reader.follow((NS, INSTANCE), lambda b: applied.append(b.ts), lambda: None)
    blocks = APPLY_SLICE + 100  # over a slice: kept, then applied by the flush task
    count = 300
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        size = 0
        for seq in range(count):  # (each payload made here, as NATS hands a new one over)
            event = BlockStored(
                block_hashes=[seq * blocks + i for i in range(blocks)],
                parent_block_hash=None if seq == 0 else seq * blocks - 1,
                token_ids=[100_000 + i for i in range(blocks)],
                block_size=1,
            )
            payload = bytes(encode_batch(KVEventBatch(float(seq), [event])))
            size += len(payload)
            headers = {layout.KIND: layout.BATCH, layout.SEQ: str(seq), layout.TS: f"{seq}.0"}
            reader.record(layout.subject(NS, INSTANCE), headers, payload)
            del event, payload
            if seq % 10 == 0:  # (a batch now and then while the flush task is idle)
                await wait_for(lambda: applied[-1:] == [float(seq)])  # noqa: B023
        await wait_for(lambda: applied[-1:] == [float(count - 1)], message="all applied")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert reader.ledger.live == 0 and reader.ledger.bytes == 0
    assert held < size / 10, f"{held} bytes held after {size} bytes of batches were applied"


async def test_the_ledger_holds_only_the_batches_kept_and_never_compacts_them_all_at_once() -> None:
    """Batches no longer kept (an instance's oldest past 4,096, dropped by a `left`) stayed in
    the ledger's order until they outnumbered the live ones, then the whole order was made
    again in one step on the event loop: at the 64 MiB bound of tiny batches (~285,000 kept)
    that pass and the free of the dead entries held the loop ~37 ms. The order now holds
    exactly the batches kept: each leaves it when it is no longer kept, in O(1)."""
    reader = KvStreamReader("nats://127.0.0.1:1")
    ledger = reader.ledger
    for instance_id in range(1, 21):  # 20 instances not followed, 5,000 tiny batches each
        subject = layout.subject("other", instance_id)
        for seq in range(5000):  # (past 4,096 kept: the oldest go as the newest come)
            headers = {layout.KIND: layout.BATCH, layout.SEQ: str(seq), layout.TS: f"{seq}.0"}
            reader.record(subject, headers, encode_batch(KVEventBatch(float(seq), [])))
            assert len(ledger.order) == ledger.live
        if instance_id % 2:
            reader.record(subject, {layout.KIND: layout.LEFT}, b"")  # (its batches dropped)
            assert len(ledger.order) == ledger.live
    assert ledger.live == 10 * 4096


def test_kept_batches_leave_nothing_for_the_garbage_collector_to_go_through() -> None:
    """Each kept batch was an object the collector tracked: a reader catching up ~285,000
    tiny batches of instances it does not follow yet (its 64 MiB bound) made every full
    collection go through them, 190-530 ms of the event loop each. A kept batch is now a
    tuple of bytes, numbers and its instance's key, which the collector stops tracking."""
    reader = KvStreamReader("nats://127.0.0.1:1")
    payload = bytes(encode_batch(KVEventBatch(1.0, [])))
    gc.collect()
    before = len(gc.get_objects())
    for seq in range(20_000):  # 20 instances, not followed
        headers = {layout.KIND: layout.BATCH, layout.SEQ: str(seq // 20), layout.TS: "1.0"}
        reader.record(layout.subject("other", 1 + seq % 20), headers, payload)
    gc.collect()
    assert reader.ledger.live == 20_000
    tracked = len(gc.get_objects()) - before
    assert tracked < 1_000, f"{tracked} objects tracked for 20,000 kept batches"
