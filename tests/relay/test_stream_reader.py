"""`KvStreamReader`'s checks of the records it reads, one unit: duplicates skipped, a gap or a
new epoch or a `resnapshot` drops what is held, records of an instance not followed yet are
kept (bounded) and applied once it is followed."""

from __future__ import annotations

import asyncio

from shoal.frontend.kv import stream as kv_stream
from shoal.frontend.kv.stream import KvStreamReader
from shoal.kv import AllBlocksCleared, BlockStored, KVEventBatch, encode_batch
from shoal.kv import stream as layout
from shoal.kv.subscription import APPLY_SLICE
from tests.helpers import wait_for

NS, INSTANCE = "ns", 0xAB
SUBJECT = layout.subject(NS, INSTANCE)


def batch(reader: KvStreamReader, seq: int, epoch: str = "e1") -> None:
    headers = {layout.KIND: layout.BATCH, layout.EPOCH: epoch, layout.SEQ: str(seq)}
    reader.record(SUBJECT, headers, encode_batch(KVEventBatch(float(seq), [AllBlocksCleared()])))


def control(reader: KvStreamReader, kind: str, seq: int = 0, epoch: str = "e1") -> None:
    headers = {layout.KIND: kind, layout.EPOCH: epoch, layout.SEQ: str(seq)}
    reader.record(SUBJECT, headers, b"")


class Follower:
    def __init__(self, reader: KvStreamReader) -> None:
        self.applied: list[int] = []
        self.purges = 0
        reader.follow((NS, INSTANCE), self.apply, self.purge)

    def apply(self, b: KVEventBatch) -> None:
        self.applied.append(int(b.ts))

    def purge(self) -> None:
        self.purges += 1


async def test_duplicates_are_skipped_and_a_gap_drops_what_is_held() -> None:
    reader = KvStreamReader("nats://127.0.0.1:1")
    follower = Follower(reader)
    for seq in (0, 1, 1, 0, 2):  # a second relay's copies, where the stream kept them
        batch(reader, seq)
    assert (follower.applied, follower.purges) == ([0, 1, 2], 0)
    batch(reader, 5)  # 3 and 4 never came
    assert (follower.applied, follower.purges) == ([0, 1, 2, 5], 1)
    batch(reader, 0, epoch="e2")  # the publisher restarted
    assert (follower.applied, follower.purges) == ([0, 1, 2, 5, 0], 2)
    control(reader, layout.RESNAPSHOT, seq=9, epoch="e2")
    batch(reader, 9, epoch="e2")  # follows the resnapshot: no gap
    assert (follower.applied[-1], follower.purges) == (9, 3)
    assert reader.stats.resnapshots == 3


async def test_an_instance_followed_late_gets_what_the_stream_held_since_its_last_loss() -> None:
    reader = KvStreamReader("nats://127.0.0.1:1")
    for seq in range(3):
        batch(reader, seq)
    control(reader, layout.RESNAPSHOT, seq=3)  # what came before is no longer true
    for seq in range(3, 6):
        batch(reader, seq)
    follower = Follower(reader)
    await wait_for(lambda: follower.applied == [3, 4, 5])
    batch(reader, 6)
    assert follower.applied == [3, 4, 5, 6]


async def test_records_kept_for_an_instance_not_followed_are_bounded_and_dropped_when_it_leaves() -> (
    None
):
    reader = KvStreamReader("nats://127.0.0.1:1")
    for seq in range(kv_stream.PENDING_BATCHES + 10):
        batch(reader, seq)
    assert len(reader.instances[(NS, INSTANCE)].pending) == kv_stream.PENDING_BATCHES
    control(reader, layout.LEFT)
    assert (NS, INSTANCE) not in reader.instances


async def test_a_batch_of_many_blocks_is_applied_in_slices_and_a_loss_stops_its_rest() -> None:
    reader = KvStreamReader("nats://127.0.0.1:1")
    parts: list[int] = []
    reader.follow(
        (NS, INSTANCE), lambda b: parts.append(len(b.events[0].block_hashes)), lambda: None
    )
    blocks = 3 * APPLY_SLICE
    event = BlockStored(list(range(blocks)), None, [1] * blocks, 1)
    headers = {layout.KIND: layout.BATCH, layout.EPOCH: "e1", layout.SEQ: "0"}
    reader.record(SUBJECT, headers, encode_batch(KVEventBatch(0.0, [event])))
    assert parts == []  # not on the reading path: queued for the flush task
    await wait_for(lambda: parts == [APPLY_SLICE] * 3)

    parts.clear()
    headers[layout.SEQ] = "1"
    reader.record(SUBJECT, headers, encode_batch(KVEventBatch(1.0, [event])))
    await asyncio.sleep(0)  # the flush task applied its first slice
    control(reader, layout.RESNAPSHOT, seq=2)  # ... and then the instance is lost
    await wait_for(lambda: reader.instances[(NS, INSTANCE)].flushing is None)
    assert parts == [APPLY_SLICE]  # the rest of the batch was dropped with it
