"""`KvStreamReader`'s checks of the records it reads, one unit: duplicates skipped, a gap or a
new run of the worker's numbering or a `resnapshot` drops what is held (a resnapshot for
batches this reader did get is ignored), records of an instance not followed yet are kept
(bounded) and applied once it is followed."""

from __future__ import annotations

import logging
import tracemalloc
from typing import Any

import nats
import pytest

from shoal.frontend.kv import stream as kv_stream
from shoal.frontend.kv.stream import KvStreamReader
from shoal.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from shoal.kv import events as kv_events
from shoal.kv import sliced as kv_sliced
from shoal.kv import stream as layout
from shoal.kv.sliced import DECODE_SLICE_BYTES
from shoal.kv.subscription import APPLY_SLICE, MAX_BATCH_BYTES
from tests.helpers import LoopTurns, turns_until, wait_for
from tests.nats_server import NatsServer

NS, INSTANCE = "ns", 0xAB
SUBJECT = layout.subject(NS, INSTANCE)


def batch(reader: KvStreamReader, seq: int, run: float = 0.0) -> None:
    """Batch `seq` of the worker's run started at `run` (its timestamp: `run + seq`)."""
    ts = run + seq
    headers = {layout.KIND: layout.BATCH, layout.SEQ: str(seq), layout.TS: repr(ts)}
    reader.record(SUBJECT, headers, encode_batch(KVEventBatch(ts, [AllBlocksCleared()])))


def control(reader: KvStreamReader, kind: str, seq: int = 0, run: float = 0.0) -> None:
    headers = {layout.KIND: kind, layout.SEQ: str(seq), layout.TS: repr(run + seq)}
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
    batch(reader, 0, run=100.0)  # the publisher restarted: numbered from 0, later
    assert (follower.applied, follower.purges) == ([0, 1, 2, 5, 100], 2)
    control(reader, layout.RESNAPSHOT, seq=9, run=100.0)
    batch(reader, 9, run=100.0)  # follows the resnapshot: no gap
    assert (follower.applied[-1], follower.purges) == (109, 3)
    assert reader.stats.resnapshots == 3


async def test_a_record_stored_after_later_ones_reads_as_a_gap_then_a_copy() -> None:
    """A relay sends up to 128 records ahead of their acknowledgements; when the stream refuses
    one (2) and stores the next (3), 2 is sent again after 3: the stream holds 3 before 2. The
    reader sees the gap at 3 (forgets the instance's blocks: never keeps an evicted one), then
    skips 2 and the copy of 3, and goes on from 4."""
    reader = KvStreamReader("nats://127.0.0.1:1")
    follower = Follower(reader)
    for seq in (0, 1, 3, 2, 3, 4):
        batch(reader, seq)
    assert (follower.applied, follower.purges) == ([0, 1, 3, 4], 1)


async def test_a_new_run_that_numbers_past_the_last_batch_read_is_told_by_its_timestamps() -> None:
    reader = KvStreamReader("nats://127.0.0.1:1")
    follower = Follower(reader)
    for seq in range(3):
        batch(reader, seq)
    batch(reader, 1, run=100.0)  # a new run (a relay joined it late: no resnapshot before it)
    assert (follower.applied, follower.purges) == ([0, 1, 2, 101], 1)
    batch(reader, 2, run=0.0)  # a late copy of the first run's batch 2: no continuation of it
    assert follower.purges == 2  # (applied alone: the index may forget, never mix the two runs)


async def test_a_resnapshot_for_batches_the_stream_holds_from_another_relay_is_ignored() -> None:
    reader = KvStreamReader("nats://127.0.0.1:1")
    follower = Follower(reader)
    for seq in range(6):  # relay A delivered every batch
        batch(reader, seq)
    control(reader, layout.RESNAPSHOT, seq=4)  # relay B dropped some before 4: A did not
    control(reader, layout.RESNAPSHOT, seq=6)  # ... or before 6
    batch(reader, 6)
    assert (follower.applied, follower.purges) == (list(range(7)), 0)
    control(reader, layout.RESNAPSHOT, seq=9)  # batches 7 and 8 are lost for this reader too
    batch(reader, 9)
    assert (follower.applied[-1], follower.purges) == (9, 1)


async def test_an_instance_followed_late_gets_what_the_stream_held_since_its_last_loss() -> None:
    reader = KvStreamReader("nats://127.0.0.1:1")
    for seq in range(3):
        batch(reader, seq)
    control(reader, layout.RESNAPSHOT, seq=4)  # batch 3 is lost: what came before is dropped
    for seq in range(4, 6):
        batch(reader, seq)
    follower = Follower(reader)
    await wait_for(lambda: follower.applied == [4, 5])
    batch(reader, 6)
    assert follower.applied == [4, 5, 6]


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
    headers = {layout.KIND: layout.BATCH, layout.SEQ: "0", layout.TS: "0.0"}
    reader.record(SUBJECT, headers, encode_batch(KVEventBatch(0.0, [event])))
    assert parts == []  # not on the reading path: queued for the flush task
    await wait_for(lambda: parts == [APPLY_SLICE] * 3)

    parts.clear()
    headers[layout.SEQ], headers[layout.TS] = "1", "1.0"
    reader.record(SUBJECT, headers, encode_batch(KVEventBatch(1.0, [event])))
    await turns_until(lambda: parts)  # the flush task applied its first slice
    control(reader, layout.RESNAPSHOT, seq=3)  # ... and then the instance is lost
    await wait_for(lambda: reader.instances[(NS, INSTANCE)].flushing is None)
    assert parts == [APPLY_SLICE]  # the rest of the batch was dropped with it


def blocks_of(events: list[Any]) -> list[tuple[Any, ...]]:
    """`events` block by block (a batch applied in slices of blocks splits its events)."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, BlockStored):
            n = e.block_size
            out += [
                ("stored", h, e.token_ids[i * n : i * n + n]) for i, h in enumerate(e.block_hashes)
            ]
        elif isinstance(e, BlockRemoved):
            out += [("removed", h) for h in e.block_hashes]
        else:
            out.append(("cleared",))
    return out


def decoded_bytes(turns: LoopTurns) -> LoopTurns:
    """`turns` counting the bytes of KV events decoded per turn of the event loop: a whole
    batch's payload (`decode_batch`, wherever it is called from) or a slice of its events."""
    turns.wrap(kv_stream, "decode_batch", len)
    turns.wrap(kv_sliced, "decode_batch", len)
    return turns.wrap(kv_sliced, "decode_events", lambda raws, *_: sum(map(len, raws)))


async def test_a_large_batch_is_decoded_a_slice_of_bytes_a_turn_and_the_batches_stay_in_order() -> (
    None
):
    """A batch of up to 4 MiB was decoded on the event loop (2.8 MB: 119 ms held), then in a
    thread, which held the loop as long (msgspec decodes in one C call holding the GIL: loop
    gaps of 29-157 ms). Now it is decoded a slice of at most `DECODE_SLICE_BYTES` of events
    a turn of the loop, all on it, by the instance's flush task: the batches after it wait for
    it, and it is applied as it was written."""
    turns = decoded_bytes(LoopTurns())
    reader = KvStreamReader("nats://127.0.0.1:1")
    got: list[KVEventBatch] = []
    reader.follow((NS, INSTANCE), got.append, lambda: None)
    size = 16  # ids over 2**16: 5 bytes each, ~165 KB an event (under `DECODE_SLICE_BYTES`)
    events = [
        BlockStored(list(range(i, i + 2048)), i or None, [(1 << 16) + i] * (2048 * size), size)
        for i in range(12)
    ]
    large = encode_batch(KVEventBatch(1.0, [AllBlocksCleared(), *events, BlockRemoved([3])]))
    assert DECODE_SLICE_BYTES < len(large) <= MAX_BATCH_BYTES
    batch(reader, 0)
    reader.record(SUBJECT, {layout.KIND: layout.BATCH, layout.SEQ: "1", layout.TS: "1.0"}, large)
    batch(reader, 2)
    batch(reader, 3)
    await wait_for(lambda: [int(b.ts) for b in got][-1:] == [3])
    await turns.stop()
    assert sorted({int(b.ts) for b in got}) == [0, 1, 2, 3]
    assert [int(b.ts) for b in got] == sorted(int(b.ts) for b in got)  # in order
    whole = [e for b in got if b.ts == 1.0 for e in b.events]
    assert blocks_of(whole) == blocks_of(decode_batch(large).events)  # (applied in slices)
    assert turns.off_loop == 0 and turns.on_loop >= len(large) - 100
    assert turns.most_per_turn <= DECODE_SLICE_BYTES, f"{turns.most_per_turn} bytes in a turn"
    assert (reader.stats.decode_errors, reader.stats.resnapshots) == (0, 0)


async def test_a_record_of_one_event_over_512_kib_is_applied_in_order_not_a_loss() -> None:
    """One `BlockStored` of a 128k-token prefill (~680 KB, over `DECODE_SLICE_BYTES`) was an
    unreadable record: a loss, the instance resnapshotted, so long prompts were never routed
    by their cache. Now it is decoded `DECODE_SLICE_ELEMENTS` elements a turn, by the flush
    task, and applied whole between the records around it."""
    elements = LoopTurns().wrap(kv_sliced, "decode_elements", lambda _, count, *__: count)
    reader = KvStreamReader("nats://127.0.0.1:1")
    got: list[KVEventBatch] = []
    reader.follow((NS, INSTANCE), got.append, lambda: None)
    tokens = [100_000 + (j * 7_919) % 28_000 for j in range(131_072)]
    event = BlockStored(list(range(1, 8_193)), None, tokens, 16)
    large = encode_batch(KVEventBatch(1.0, [BlockRemoved([5]), event, AllBlocksCleared()]))
    assert DECODE_SLICE_BYTES < len(large) <= MAX_BATCH_BYTES
    batch(reader, 0)
    reader.record(SUBJECT, {layout.KIND: layout.BATCH, layout.SEQ: "1", layout.TS: "1.0"}, large)
    batch(reader, 2)
    await wait_for(lambda: [int(b.ts) for b in got][-1:] == [2])
    await elements.stop()
    assert [int(b.ts) for b in got] == sorted(int(b.ts) for b in got)  # in order
    whole = [e for b in got if b.ts == 1.0 for e in b.events]
    assert blocks_of(whole) == blocks_of(decode_batch(large).events)  # (applied in slices)
    assert (reader.stats.decode_errors, reader.stats.resnapshots) == (0, 0)
    assert elements.on_loop == len(tokens) + 8_192
    assert elements.most_per_turn <= kv_sliced.DECODE_SLICE_ELEMENTS


async def test_a_record_of_many_tiny_events_is_decoded_a_bounded_count_of_events_a_turn() -> None:
    """8,192 removals of one block (~170 KB, under `DECODE_SLICE_BYTES`) were decoded in one
    call, on the reading path. Now a record of more than `DECODE_SLICE_EVENTS` events goes to
    the flush task, decoded that many events a turn, and the records after it wait for it."""
    decoded = LoopTurns().wrap(kv_stream, "decode_batch", kv_events.declared_events)
    decoded.wrap(kv_sliced, "decode_batch", kv_events.declared_events)
    decoded.wrap(kv_sliced, "decode_events", lambda raws, *_: len(raws))
    reader = KvStreamReader("nats://127.0.0.1:1")
    got: list[KVEventBatch] = []
    reader.follow((NS, INSTANCE), got.append, lambda: None)
    tiny = [BlockRemoved([i]) for i in range(kv_events.MAX_BATCH_EVENTS)]
    payload = encode_batch(KVEventBatch(1.0, tiny))
    assert len(payload) < DECODE_SLICE_BYTES
    batch(reader, 0)
    reader.record(SUBJECT, {layout.KIND: layout.BATCH, layout.SEQ: "1", layout.TS: "1.0"}, payload)
    batch(reader, 2)
    await wait_for(lambda: [int(b.ts) for b in got][-1:] == [2])
    await decoded.stop()
    assert [int(b.ts) for b in got] == sorted(int(b.ts) for b in got)  # in order
    assert blocks_of([e for b in got if b.ts == 1.0 for e in b.events]) == blocks_of(tiny)
    assert decoded.on_loop == 2 + len(tiny)
    assert decoded.most_per_turn <= kv_sliced.DECODE_SLICE_EVENTS < len(tiny)
    assert (reader.stats.decode_errors, reader.stats.resnapshots) == (0, 0)


async def test_records_kept_for_instances_not_followed_are_bounded_in_bytes_oldest_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every namespace's records are in the stream, and a frontend follows a few: what it
    keeps of the others (until the registry follows them) is bounded in bytes across all of
    them, not only in batches per instance (4,096 batches of up to 4 MiB each, per instance
    of every namespace). The oldest go first; an instance followed later gets the newest."""
    monkeypatch.setattr(kv_stream, "PENDING_BYTES", 1 << 20, raising=False)
    reader = KvStreamReader("nats://127.0.0.1:1")
    blocks = 4096  # ~16 KiB of token ids a batch
    event = BlockStored(list(range(blocks)), None, [1] * blocks, 1)
    for seq in range(20):
        payload = encode_batch(KVEventBatch(float(seq), [event]))
        for instance_id in range(1, 41):  # 40 instances x 20 batches: ~13 MiB
            headers = {layout.KIND: layout.BATCH, layout.SEQ: str(seq), layout.TS: f"{seq}.0"}
            reader.record(layout.subject(NS, instance_id), headers, payload)
    kept = sum(len(i.pending) for i in reader.instances.values())
    assert kept * len(payload) <= (1 << 20) + len(payload), f"{kept} batches kept"
    applied: list[float] = []
    reader.follow((NS, 40), lambda b: applied.append(b.ts), lambda: None)
    await wait_for(lambda: applied[-1:] == [19.0], message="the newest batch kept, applied")


async def test_the_bytes_kept_for_instances_not_followed_are_what_the_reader_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bound on what is kept for instances not followed counted payload bytes but kept
    batches decoded: a 3-byte batch held ~250 bytes of objects, so the reader held ~83
    times `PENDING_BYTES` (and /health `kept_bytes` said the payload's figure). Batches are
    now kept as they came and counted with the objects keeping them: what the reader holds
    is within its bound, and `kept_bytes` says so; a batch kept is still applied."""
    monkeypatch.setattr(kv_stream, "PENDING_BYTES", 1 << 20, raising=False)
    reader = KvStreamReader("nats://127.0.0.1:1")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for instance_id in range(1, 41):  # 40 instances x 1,000 batches of 3 bytes
            subject = layout.subject("other", instance_id)
            for seq in range(1000):
                payload = bytes(encode_batch(KVEventBatch(float(seq), [])))  # (its own object)
                headers = {layout.KIND: layout.BATCH, layout.SEQ: str(seq), layout.TS: f"{seq}.0"}
                reader.record(subject, headers, payload)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert reader.ledger.live > 1000  # (it does keep some)
    shown = reader.describe()["kept_bytes"]
    assert isinstance(shown, int) and shown <= kv_stream.PENDING_BYTES
    assert held <= 1.25 * kv_stream.PENDING_BYTES, f"{held} bytes held, {shown} shown"
    assert held <= 1.25 * shown, f"{held} bytes held, {shown} shown"
    applied: list[float] = []
    reader.follow(("other", 40), lambda b: applied.append(b.ts), lambda: None)
    await wait_for(lambda: applied[-1:] == [999.0], message="the batches kept, applied")


async def test_an_instance_that_left_while_followed_is_forgotten_when_unfollowed() -> None:
    """A `left` for an instance still followed was ignored (the registry drops it a moment
    later) and `unfollow` kept its entry: with worker churn `instances` (and /health's
    count) grew without bound. The `left` is now remembered and the entry goes at
    `unfollow`; an instance unfollowed without one keeps its place in the stream."""
    reader = KvStreamReader("nats://127.0.0.1:1")
    for instance_id in range(1, 1001):
        key, subject = ("ns", instance_id), layout.subject("ns", instance_id)
        reader.follow(key, lambda b: None, lambda: None)
        headers = {layout.KIND: layout.BATCH, layout.SEQ: "0", layout.TS: "1.0"}
        reader.record(subject, {layout.KIND: layout.JOINED}, b"{}")
        reader.record(subject, headers, encode_batch(KVEventBatch(1.0, [AllBlocksCleared()])))
        reader.record(subject, {layout.KIND: layout.LEFT}, b"")  # (the relay saw it first)
        reader.unfollow(key)  # (then the frontend's registry)
    assert not reader.instances and reader.describe()["instances"] == 0
    follower = Follower(reader)
    batch(reader, 0)
    reader.unfollow((NS, INSTANCE))  # (no `left`: routed elsewhere for now)
    assert reader.instances[(NS, INSTANCE)].last_seq == 0
    assert follower.applied == [0]


async def test_instances_not_followed_are_forgotten_when_they_hold_nothing_and_bounded_in_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An instance not followed stayed known after its batches were all forgotten to keep
    within `PENDING_BYTES`, and after `unfollow` without a `left` (its relay killed): 200,000
    instances of other namespaces held ~227 MB. Now one whose batches are forgotten goes
    with them, and at most `MAX_UNFOLLOWED` are known, the one read least recently out
    (a followed one never is); the newest keep their place in the stream."""
    monkeypatch.setattr(kv_stream, "PENDING_BYTES", 1 << 20, raising=False)
    monkeypatch.setattr(kv_stream, "MAX_UNFOLLOWED", 1000, raising=False)
    reader = KvStreamReader("nats://127.0.0.1:1")
    follower = Follower(reader)
    payload = encode_batch(KVEventBatch(1.0, [AllBlocksCleared()]))
    headers = {layout.KIND: layout.BATCH, layout.SEQ: "0", layout.TS: "1.0"}
    for instance_id in range(1, 20_001):  # of namespaces this frontend does not serve
        reader.record(layout.subject("other", instance_id), headers, payload)
    assert all(i.pending for k, i in reader.instances.items() if k != (NS, INSTANCE))
    assert len(reader.instances) <= 1001 and reader.ledger.live <= 1000
    assert ("other", 20_000) in reader.instances
    for instance_id in range(1, 5001):  # followed, then not (no `left`: relays killed)
        key = ("churn", instance_id)
        reader.follow(key, lambda b: None, lambda: None)
        reader.record(layout.subject(*key), headers, payload)
        reader.unfollow(key)
    assert len(reader.instances) <= 1001 and len(reader.unfollowed) <= 1000
    assert reader.instances[("churn", 5000)].last_seq == 0  # (its place kept)
    batch(reader, 0)
    assert follower.applied == [0]  # (followed: never forgotten)


async def test_a_record_of_too_many_events_is_a_loss_counted_not_decoded() -> None:
    """250,000 events of no block fit in a 4 MiB record and took 70-230 ms to decode on the
    event loop: refused by their count, a loss like an unreadable record."""
    reader = KvStreamReader("nats://127.0.0.1:1")
    follower = Follower(reader)
    batch(reader, 0)
    headers = {layout.KIND: layout.BATCH, layout.SEQ: "1", layout.TS: "1.0"}
    reader.record(SUBJECT, headers, encode_batch(KVEventBatch(1.0, [BlockRemoved([])] * 250_000)))
    batch(reader, 2)
    await wait_for(lambda: follower.applied == [0, 2])
    assert (reader.stats.decode_errors, follower.purges) == (1, 1)


async def test_a_record_naming_a_block_with_a_huge_hash_is_a_loss_counted() -> None:
    """An engine hash over 64 bytes (the index keeps hashes as keys, bounded by count only)
    makes the record unreadable: a loss, as it is for a subscription."""
    reader = KvStreamReader("nats://127.0.0.1:1")
    follower = Follower(reader)
    batch(reader, 0)
    event = BlockStored([bytes(4096)], None, [1], 1)
    headers = {layout.KIND: layout.BATCH, layout.SEQ: "1", layout.TS: "1.0"}
    reader.record(SUBJECT, headers, encode_batch(KVEventBatch(1.0, [event])))
    batch(reader, 2)
    await wait_for(lambda: follower.applied == [0, 2])
    assert (reader.stats.decode_errors, follower.purges) == (1, 1)


async def test_the_state_shown_follows_the_nats_connection_and_errors_are_logged_once(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NATS down: `/health` said connected until a look at the stream timed out (~10 s), and
    nats-py logged a traceback at every attempt to reconnect. Now the reader's state follows
    the connection's callbacks, and each error is logged once, without a traceback."""
    monkeypatch.setattr(kv_stream, "STREAM_CHECK", 3600.0)  # only the connection can tell
    nc = await nats.connect(nats_server.url)
    await nc.jetstream().add_stream(name="kvs", subjects=[f"{layout.SUBJECT_PREFIX}.>"])
    await nc.close()
    attempts: list[Exception] = []  # nats-py's errors, one an attempt to reconnect
    told = getattr(KvStreamReader, "_error", None)

    async def error(self: KvStreamReader, exc: Exception) -> None:
        attempts.append(exc)
        if told is not None:
            await told(self, exc)

    monkeypatch.setattr(KvStreamReader, "_error", error, raising=False)
    caplog.set_level(logging.INFO)
    reader = KvStreamReader(nats_server.url, "kvs")
    reader.start()
    try:
        await wait_for(lambda: reader.describe()["connected"], message="connected")
        nats_server.stop()
        await wait_for(lambda: not reader.describe()["connected"], message="seen down")
        assert reader.describe()["error"]
        await wait_for(lambda: len(attempts) >= 3, timeout=30, message="reconnections tried")
        nats_server.start()
        await wait_for(lambda: reader.describe()["connected"], timeout=30, message="back")
        assert reader.describe()["error"] is None
    finally:
        await reader.close()
    tracebacks = [r for r in caplog.records if r.name.startswith("nats") and r.exc_info]
    assert tracebacks == []
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == kv_stream.log.name and r.levelno >= logging.WARNING
    ]
    assert warned and len(warned) == len(set(warned)), warned
