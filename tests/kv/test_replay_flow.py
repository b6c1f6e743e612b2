"""A busy worker's history reaches a new subscriber whole (replay with flow control), an
event flood never holds the event loop, the index is bounded per instance, and a malformed
replay endpoint is refused where it enters and never kills a live subscription."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import zmq.asyncio

from shoal.discovery import InstanceInfo
from shoal.frontend.kv.index import KvIndex
from shoal.kv import (
    BlockRemoved,
    BlockStored,
    KvEndpoint,
    KVEventBatch,
    encode_batch,
    subscription,
    token_block_hashes,
)
from shoal.kv import events as kv_events
from shoal.kv import sliced as kv_sliced
from shoal.kv.events import MAX_BATCH_EVENTS
from shoal.kv.sliced import DECODE_SLICE_BYTES
from shoal.kv.subscription import APPLY_SLICE, YIELD_EVERY, KvStats, KvSubscription
from shoal.worker.kv_publisher import KvEventPublisher
from tests.helpers import LoopTurns, wait_for
from tests.kv import vllm_fixtures as vllm
from tests.kv.fake_vllm import FakeVllmPublisher
from tests.kv.subscribers import raw_subscriptions, start_seeing_subscribers, subscribed

BS = 256  # tokens a block: ~1.2 KB a batch with ids of 5 bytes
BATCHES = 20_000


def block_tokens(i: int) -> list[int]:
    return [100_000 + (i * BS + j) % 900_000 for j in range(BS)]


def store(publisher: KvEventPublisher, i: int) -> None:
    """Publish batch i: block i, chained to block i - 1."""
    publisher.record(
        BlockStored(
            block_hashes=[i],
            parent_block_hash=None if i == 0 else i - 1,
            token_ids=block_tokens(i),
            block_size=BS,
        )
    )
    publisher.flush()


@pytest.fixture
async def publisher() -> AsyncIterator[KvEventPublisher]:
    pub = KvEventPublisher(buffer=BATCHES + 1)
    await start_seeing_subscribers(pub)
    yield pub
    await pub.close()


def subscribe(
    ctx: zmq.asyncio.Context,
    endpoint: KvEndpoint,
    index: KvIndex,
    stats: KvStats,
    turns: LoopTurns | None = None,
) -> KvSubscription:
    """A subscription of instance 7 applying its batches to `index`; `turns`, when given,
    counts the batches applied per turn of the event loop."""

    def apply(seq: int, batch: KVEventBatch) -> None:
        if turns is not None:
            turns.note()
        for event in batch.events:
            index.apply(7, event)

    sub = KvSubscription(ctx, 7, endpoint, apply, lambda: index.purge(7), stats)
    sub.start()
    return sub


async def test_a_busy_workers_whole_history_is_replayed_without_stalling_the_loop(
    publisher: KvEventPublisher,
) -> None:
    for i in range(BATCHES):  # before anyone subscribed: only a replay can tell
        store(publisher, i)
    assert len(publisher.buffer[0][1]) > 1_000
    assert publisher.endpoint is not None
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(BS), KvStats()
    turns = LoopTurns()  # batches (of one block) applied per turn of the loop
    sub = subscribe(ctx, publisher.endpoint, index, stats, turns)
    try:
        await wait_for(lambda: sub.last_seq == BATCHES - 1, timeout=60, message="replayed")
        assert index.instance_blocks(7) == BATCHES  # every block indexed
        assert stats.resnapshots == 0
        assert turns.on_loop == BATCHES
        assert turns.most_per_turn <= YIELD_EVERY, f"{turns.most_per_turn} batches in one turn"
    finally:
        await turns.stop()
        await sub.stop()
        ctx.destroy(linger=0)


def shown_whole(publisher: KvEventPublisher, sub: KvSubscription) -> Callable[[], bool]:
    """A condition: `sub` applied every batch `publisher` published. A burst's tail dropped
    by a full queue shows only by a later batch, and one published while the queue is still
    full is dropped too: while `sub` applies nothing, each check publishes one more batch
    (storing the next block), until one gets through."""
    seen: list[int | None] = [None]  # (the first check publishes nothing: `sub` had no turn)

    def check() -> bool:
        if sub.last_seq == publisher.next_seq - 1:
            return True
        if sub.last_seq == seen[0]:
            store(publisher, publisher.next_seq)
        seen[0] = sub.last_seq
        return False

    return check


async def test_a_live_flood_is_applied_in_slices(publisher: KvEventPublisher) -> None:
    assert publisher.endpoint is not None
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(BS), KvStats()
    turns = LoopTurns()  # batches (of one block) applied per turn of the loop
    sub = subscribe(ctx, publisher.endpoint, index, stats, turns)
    try:
        await wait_for(lambda: stats.replays == 1, message="subscribed")
        await subscribed(publisher)  # (a batch published before it would be lost)
        for i in range(BATCHES):  # a burst: the batches queue up at the subscriber
            store(publisher, i)
        await wait_for(shown_whole(publisher, sub), timeout=60, interval=0.1, message="applied")
        published = publisher.next_seq
        assert published > BATCHES
        assert index.instance_blocks(7) == published
        assert turns.on_loop == published  # (each once, live or replayed)
        assert turns.most_per_turn <= YIELD_EVERY, f"{turns.most_per_turn} batches in one turn"
    finally:
        await turns.stop()
        await sub.stop()
        ctx.destroy(linger=0)


async def test_a_request_older_than_the_buffer_replays_from_the_oldest_batch() -> None:
    pub = KvEventPublisher(buffer=100)
    await pub.start()
    try:
        for i in range(250):
            store(pub, i)
        replayed = pub.replay_from(0)
        assert [seq for seq, _ in replayed] == list(range(150, 250))
        assert [seq for seq, _ in pub.replay_from(200)] == list(range(200, 250))
        assert pub.replay_from(250) == []
    finally:
        await pub.close()


def test_an_instance_over_the_block_cap_is_purged_and_reported() -> None:
    index = KvIndex(2, max_instance_blocks=10)
    tokens = list(range(40))
    for i in range(20):
        index.apply(
            7,
            BlockStored(
                block_hashes=[i],
                parent_block_hash=None if i == 0 else i - 1,
                token_ids=tokens[2 * i : 2 * i + 2],
                block_size=2,
            ),
        )
    assert index.instance_blocks(7) <= 10
    assert index.over_cap == {7: 1}
    assert not index.overlaps(token_block_hashes(tokens, 2))  # nothing half-known kept


def test_a_replay_endpoint_without_a_port_is_refused_where_it_enters() -> None:
    with pytest.raises(ValueError, match="tcp://host:port"):
        KvEndpoint(publisher="tcp://127.0.0.1:5557", replay="tcp://host")
    record = {
        "namespace": "ns", "component": "c", "endpoint": "e", "instance_id": 1,
        "url": "http://127.0.0.1:1", "status_url": "http://127.0.0.1:1",
        "kv_events": {"publisher": "tcp://127.0.0.1:5557", "replay": "tcp://host"},
    }  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="tcp://host"):
        msgspec.json.decode(msgspec.json.encode(record), type=InstanceInfo)
    flag = subprocess.run(
        [sys.executable, "-c", "from shoal.cli.main import main; main()", "worker", "--engine", "openai",
         "--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-replay-endpoint", "tcp://host"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert flag.returncode == 2 and "--kv-replay-endpoint" in flag.stderr, flag.stderr


async def test_a_bad_replay_endpoint_keeps_the_live_stream(
    publisher: KvEventPublisher,
) -> None:
    assert publisher.endpoint is not None
    endpoint = KvEndpoint(publisher=publisher.endpoint.publisher)
    msgspec.structs.force_setattr(endpoint, "replay", "tcp://host")  # past the checks
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(BS), KvStats()
    sub = subscribe(ctx, endpoint, index, stats)
    try:
        await wait_for(lambda: sub.replay_broken, message="the replay endpoint given up")
        await subscribed(publisher)  # (a batch published before it would be lost)
        store(publisher, 0)
        await wait_for(lambda: index.instance_blocks(7) == 1, message="the live batch applied")
        assert sub.task is not None and not sub.task.done()
    finally:
        await sub.stop()
        ctx.destroy(linger=0)


async def test_a_replay_cut_short_by_a_dropping_publisher_is_kept_and_resumed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM's replay socket sends everything at once and drops what its queue cannot hold,
    # the end marker included: what did arrive is applied, the rest asked for again.
    monkeypatch.setattr(subscription, "REPLAY_TIMEOUT", 0.5)
    fake = FakeVllmPublisher()
    count = 20_000  # ~24 MB: more than loopback's buffers and the subscriber's queue hold,
    # however fast the subscriber reads on a busy machine (5,000 were, at times, not cut)
    for i in range(count):
        event = ["BlockStored", [i], None if i == 0 else i - 1, block_tokens(i), BS, None]
        await fake.send(i, vllm.batch(event), live=False)
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(BS), KvStats()
    endpoint = KvEndpoint(publisher=fake.endpoint, replay=fake.replay_endpoint)
    sub = subscribe(ctx, endpoint, index, stats)
    try:
        await wait_for(lambda: sub.last_seq == count - 1, timeout=90, message="replayed")
        assert index.instance_blocks(7) == count
        assert len(fake.replay_requests) > 1  # (it was cut short, then resumed)
        assert stats.resnapshots == 0
    finally:
        await sub.stop()
        ctx.destroy(linger=0)
        await fake.close()


async def test_one_batch_of_many_blocks_is_applied_in_slices(publisher: KvEventPublisher) -> None:
    """A batch is one message, and a single event in it can store 100,000 blocks (0.5 MB with
    one-token blocks): applied in one go 200,000 held the loop ~0.2 s; now in slices, to the
    same index, and a removal of as many blocks likewise."""
    assert publisher.endpoint is not None
    blocks = 100_000
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(1), KvStats()
    blocks_applied = LoopTurns().wrap(index, "apply", lambda _, event: len(event.block_hashes))
    decoded = decoded_bytes(LoopTurns())
    elements = LoopTurns().wrap(kv_sliced, "decode_elements", lambda _, count, *__: count)
    sub = subscribe(ctx, publisher.endpoint, index, stats)
    try:
        await wait_for(lambda: stats.replays == 1, message="subscribed")
        await subscribed(publisher)  # (a batch published before it would be lost)
        hashes = list(range(1, blocks + 1))
        event = BlockStored(hashes, None, [j % 100 for j in range(blocks)], 1)
        expected = KvIndex(1)
        expected.stored(7, event)
        publisher.record(event)
        publisher.flush()  # (the publisher's encoding is not the subscriber's hold)
        await wait_for(lambda: sub.last_seq == 0, timeout=30, message="applied")
        assert index.instance_blocks(7) == blocks
        assert index.holders == expected.holders  # the same chain of hashes as in one go
        publisher.record(BlockRemoved(block_hashes=hashes[1:]))
        publisher.flush()
        await wait_for(lambda: sub.last_seq == 1, timeout=30, message="removed")
        assert index.instance_blocks(7) == 1
        assert blocks_applied.on_loop == 2 * blocks - 1
        most = blocks_applied.most_per_turn
        assert most <= APPLY_SLICE, f"{most} blocks applied in one turn of the loop"
        # (each message, about 0.5 MB, is one event over `DECODE_SLICE_BYTES`: its arrays are
        # decoded a slice of elements a turn, on the loop)
        assert decoded.off_loop == 0 and decoded.most_per_turn <= DECODE_SLICE_BYTES
        assert elements.on_loop == 3 * blocks - 1 and elements.off_loop == 0
        assert elements.most_per_turn <= kv_sliced.DECODE_SLICE_ELEMENTS
    finally:
        await blocks_applied.stop()
        await decoded.stop()
        await elements.stop()
        await sub.stop()
        ctx.destroy(linger=0)


async def test_a_batch_over_the_size_bound_is_refused_unread_and_counted_as_a_loss(
    publisher: KvEventPublisher,
) -> None:
    """A batch is decoded on the event loop in one step: a publisher's 6 MB message (about
    50 times an engine step's) held it ~55 ms, and 50 MB ~0.5 s. Now a batch
    over `MAX_BATCH_BYTES` is a loss like an unreadable one: never decoded, the instance's
    blocks are dropped, and the stream goes on."""
    assert publisher.endpoint is not None
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(BS), KvStats()
    sub = subscribe(ctx, publisher.endpoint, index, stats)
    try:
        await wait_for(lambda: stats.replays == 1, message="subscribed")
        await subscribed(publisher)  # (a batch published before it would be lost)
        store(publisher, 0)
        await wait_for(lambda: sub.last_seq == 0, message="first batch")
        huge = 6 << 20
        publisher.record(BlockStored([1], 0, [1] * huge, huge))
        publisher.flush()
        store(publisher, 2)
        await wait_for(lambda: sub.last_seq == 2, timeout=30, message="went on")
        assert (stats.batches, stats.decode_errors, stats.resnapshots) == (2, 1, 1)
    finally:
        await sub.stop()
        ctx.destroy(linger=0)


def test_events_of_no_block_count_in_a_slice() -> None:
    """An event storing or removing no block is still work to apply: 250,000 of them were
    applied in one slice."""
    events: list[BlockStored | BlockRemoved] = [BlockRemoved([])] * 3000
    parts = list(subscription.slices(KVEventBatch(0.0, events)))
    assert [len(p.events) for p in parts] == [1024, 1024, 952]


async def test_a_batch_of_too_many_events_is_refused_unread_and_counted_as_a_loss(
    publisher: KvEventPublisher,
) -> None:
    """250,000 events of no block are 3.7 MB, under the size bound, and took 70-230 ms to
    decode on the event loop: a batch over `MAX_BATCH_EVENTS` is a loss like an unreadable
    one (the instance's blocks dropped), and the stream goes on."""
    assert publisher.endpoint is not None
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(BS), KvStats()
    sub = subscribe(ctx, publisher.endpoint, index, stats)
    try:
        await wait_for(lambda: stats.replays == 1, message="subscribed")
        await subscribed(publisher)  # (a batch published before it would be lost)
        store(publisher, 0)
        await wait_for(lambda: sub.last_seq == 0, message="first batch")
        assert index.instance_blocks(7) == 1
        for _ in range(250_000):
            publisher.record(BlockRemoved(block_hashes=[]))
        publisher.flush()
        store(publisher, 2)
        await wait_for(lambda: sub.last_seq == 2, timeout=30, message="went on")
        assert (stats.batches, stats.decode_errors, stats.resnapshots) == (2, 1, 1)
        assert index.instance_blocks(7) == 0  # block 0 dropped; block 2's parent with it
    finally:
        await sub.stop()
        ctx.destroy(linger=0)


def decoded_bytes(turns: LoopTurns) -> LoopTurns:
    """`turns` counting the bytes of KV events decoded per turn of the event loop: a whole
    batch's payload (`decode_batch`) or a slice of its events (`decode_events`)."""
    turns.wrap(kv_sliced, "decode_batch", len)
    return turns.wrap(kv_sliced, "decode_events", lambda raws, *_: sum(map(len, raws)))


async def test_a_large_batch_is_decoded_a_slice_of_bytes_a_turn_on_the_loop(
    publisher: KvEventPublisher,
) -> None:
    """A batch within every bound (4 MiB of token ids) took 30-90 ms to decode, on the event
    loop, then in a thread that held the loop as long (msgspec holds the GIL for its one C
    call). Now at most `DECODE_SLICE_BYTES` of its events are decoded a turn of the loop,
    applied in order and as written."""
    assert publisher.endpoint is not None
    turns = decoded_bytes(LoopTurns())
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(BS), KvStats()
    sub = subscribe(ctx, publisher.endpoint, index, stats)
    try:
        await wait_for(lambda: stats.replays == 1, message="subscribed")
        await subscribed(publisher)  # (a batch published before it would be lost)
        store(publisher, 0)
        await wait_for(lambda: sub.last_seq == 0, message="first batch")
        blocks = 150  # (~190 KB an event, under `DECODE_SLICE_BYTES`: ids of 5 bytes)
        events = [
            BlockStored(
                list(range(1 + i * blocks, 1 + (i + 1) * blocks)),
                i * blocks or 0,
                [t for b in range(i * blocks + 1, (i + 1) * blocks + 1) for t in block_tokens(b)],
                BS,
            )
            for i in range(16)
        ]
        payload = encode_batch(KVEventBatch(1.0, events))
        assert subscription.MAX_BATCH_BYTES >= len(payload) > 2 * DECODE_SLICE_BYTES
        for event in events:
            publisher.record(event)
        publisher.flush()
        store(publisher, 2400 + 1)
        await wait_for(lambda: sub.last_seq == 2, timeout=30, message="went on")
        assert stats.decode_errors == 0 and stats.batches == 3 and stats.resnapshots == 0
        assert index.instance_blocks(7) == 16 * blocks + 2
        assert turns.off_loop == 0 and turns.on_loop >= len(payload) - 100
        assert turns.most_per_turn <= DECODE_SLICE_BYTES, f"{turns.most_per_turn} bytes a turn"
    finally:
        await turns.stop()
        await sub.stop()
        ctx.destroy(linger=0)


async def test_a_kv_event_over_512_kib_is_applied_not_refused(publisher: KvEventPublisher) -> None:
    """vLLM publishes one `BlockStored` per prefill: a 128k-token prompt's is ~680 KB (its
    token ids alone ~650 KB), over `DECODE_SLICE_BYTES`. It was refused as unreadable (a loss,
    the instance resnapshotted, every long prompt again): long-context workloads got no
    KV-aware routing. Now its arrays are decoded `DECODE_SLICE_ELEMENTS` elements a turn of
    the loop, and its blocks are indexed: a prompt starting with those tokens finds them."""
    assert publisher.endpoint is not None
    size = 16
    tokens = [100_000 + (j * 7_919) % 28_000 for j in range(131_072)]  # (5 bytes an id)
    event = BlockStored(list(range(1, len(tokens) // size + 1)), None, tokens, size)
    payload = encode_batch(KVEventBatch(1.0, [event]))
    assert DECODE_SLICE_BYTES < len(payload) <= subscription.MAX_BATCH_BYTES
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(size), KvStats()
    elements = LoopTurns().wrap(kv_sliced, "decode_elements", lambda _, count, *__: count)
    sub = subscribe(ctx, publisher.endpoint, index, stats)
    try:
        await wait_for(lambda: stats.replays == 1, message="subscribed")
        await subscribed(publisher)  # (a batch published before it would be lost)
        publisher.record(event)
        publisher.flush()
        await wait_for(lambda: sub.last_seq == 0, timeout=30, message="read")
        assert (stats.batches, stats.decode_errors, stats.resnapshots) == (1, 0, 0)
        assert index.instance_blocks(7) == len(tokens) // size
        routable = token_block_hashes(tokens, size)
        assert all(index.holders.get(h) == {7} for h in routable)  # a prompt's blocks found
        assert elements.on_loop == len(tokens) + len(tokens) // size
        assert elements.most_per_turn <= kv_sliced.DECODE_SLICE_ELEMENTS
    finally:
        await elements.stop()
        await sub.stop()
        ctx.destroy(linger=0)


async def test_a_batch_of_many_tiny_events_is_decoded_a_bounded_count_of_events_a_turn(
    publisher: KvEventPublisher,
) -> None:
    """8,192 removals of one block are ~170 KB, under `DECODE_SLICE_BYTES`: decoded in one
    call, far more objects than a slice of large events makes. Now at most
    `DECODE_SLICE_EVENTS` events are decoded a turn of the loop, applied in order."""
    assert publisher.endpoint is not None
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(BS), KvStats()
    decoded = LoopTurns().wrap(kv_sliced, "decode_batch", kv_events.declared_events)
    decoded.wrap(kv_sliced, "decode_events", lambda raws, *_: len(raws))
    sub = subscribe(ctx, publisher.endpoint, index, stats)
    try:
        await wait_for(lambda: stats.replays == 1, message="subscribed")
        await subscribed(publisher)  # (a batch published before it would be lost)
        for i in range(3):
            store(publisher, i)
        for i in range(MAX_BATCH_EVENTS):  # (the first removes block 1; the others no block)
            publisher.record(BlockRemoved(block_hashes=[1 + i * 1_000]))
        publisher.flush()
        await wait_for(lambda: sub.last_seq == 3, timeout=30, message="read")
        assert (stats.batches, stats.decode_errors, stats.resnapshots) == (4, 0, 0)
        assert index.instance_blocks(7) == 2
        assert decoded.on_loop == 3 + MAX_BATCH_EVENTS
        assert decoded.most_per_turn <= kv_sliced.DECODE_SLICE_EVENTS < MAX_BATCH_EVENTS
    finally:
        await decoded.stop()
        await sub.stop()
        ctx.destroy(linger=0)


async def test_a_flood_of_unreadable_batches_is_logged_once_and_counted_each(
    publisher: KvEventPublisher, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken or hostile publisher sends unreadable batches as fast as it likes: each is a
    loss counted in `decode_errors`, but the log says so once a minute per instance, not
    once per batch (20 a second filled an operator's log)."""
    assert publisher.endpoint is not None
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(BS), KvStats()
    sub = subscribe(ctx, publisher.endpoint, index, stats)
    try:
        await wait_for(lambda: stats.replays == 1, message="subscribed")
        await subscribed(publisher)  # (a batch published before it would be lost)
        store(publisher, 0)
        await wait_for(lambda: sub.last_seq == 0, message="first batch")
        caplog.set_level("WARNING", logger="shoal.kv.subscription")
        for _ in range(5):
            for _ in range(MAX_BATCH_EVENTS + 1):
                publisher.record(BlockRemoved(block_hashes=[]))
            publisher.flush()
        store(publisher, 6)
        await wait_for(lambda: sub.last_seq == 6, timeout=30, message="went on")
        assert (stats.batches, stats.decode_errors, stats.resnapshots) == (2, 5, 5)
        said = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
        assert len(said) == 1, said
        assert "batch 1 unreadable" in said[0]
    finally:
        await sub.stop()
        ctx.destroy(linger=0)


async def test_a_batch_naming_a_block_with_a_huge_hash_is_a_loss_counted(
    publisher: KvEventPublisher,
) -> None:
    """Engine hashes are kept as the index's keys: a worker naming its blocks with 4 KB hashes
    (1,000 blocks a batch, within every other bound) made ~1 GiB an instance at the block
    cap. A batch holding a hash over 64 bytes is unreadable: a loss, never indexed."""
    assert publisher.endpoint is not None
    ctx, index, stats = zmq.asyncio.Context(), KvIndex(1), KvStats()
    sub = subscribe(ctx, publisher.endpoint, index, stats)
    try:
        await wait_for(lambda: stats.replays == 1, message="subscribed")
        await subscribed(publisher)  # (a batch published before it would be lost)
        publisher.record(BlockStored([b"a" * 32], None, [1], 1))
        publisher.flush()
        await wait_for(lambda: sub.last_seq == 0, message="first batch")
        assert index.instance_blocks(7) == 1
        hashes: list[int | bytes] = [i.to_bytes(4, "big") + bytes(4092) for i in range(1000)]
        publisher.record(BlockStored(hashes, None, [7] * 1000, 1))
        publisher.flush()
        publisher.record(BlockStored([b"b" * 32], None, [2], 1))
        publisher.flush()
        await wait_for(lambda: sub.last_seq == 2, timeout=30, message="went on")
        assert (stats.batches, stats.decode_errors, stats.resnapshots) == (2, 1, 1)
        assert index.instance_blocks(7) == 1  # the block stored after the loss, alone
    finally:
        await sub.stop()
        ctx.destroy(linger=0)


async def test_a_replay_peer_sending_an_oversized_frame_is_disconnected_unread(
    publisher: KvEventPublisher,
) -> None:
    """The replay socket took a message of any size (one 600 MB frame grew the worker by
    600 MB before `_serve_replays` saw it). Now a frame over 4 KiB (`MAX_INBOUND_BYTES`)
    disconnects its peer unread, and a well-formed request still gets its replay."""
    from zmq.utils.monitor import parse_monitor_message

    from shoal.kv.events import encode_seq

    store(publisher, 0)
    assert publisher.endpoint is not None
    ctx = zmq.asyncio.Context()
    big = ctx.socket(zmq.DEALER)
    good = ctx.socket(zmq.DEALER)
    try:
        for sock in (big, good):
            sock.setsockopt(zmq.LINGER, 0)
        monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        big.connect(publisher.endpoint.replay)
        # A replay request but for a 100 KB frame (a request is a few bytes): read, it
        # would be answered.
        await big.send_multipart([b"", b"x" * 100_000, encode_seq(0)])
        event = await asyncio.wait_for(monitor.recv_multipart(), 10)
        assert parse_monitor_message(event)["event"] == zmq.EVENT_DISCONNECTED
        good.connect(publisher.endpoint.replay)
        await good.send_multipart([b"", encode_seq(0)])
        first = await asyncio.wait_for(good.recv_multipart(), 10)
        assert first[0] == b"" and len(first) > 1, first
    finally:
        ctx.destroy(linger=0)


async def test_a_large_batch_applied_is_freed_a_slice_a_turn() -> None:
    """A decoded 4 MB batch freed at once held the loop 6-10 ms (a million ints): once applied,
    its events are freed `FREE_SLICE` token ids and hashes a turn of the loop at most."""
    events = [BlockStored(list(range(i, i + 64)), None, list(range(4096)), 64) for i in range(64)]
    batch = KVEventBatch(1.0, list(events))
    weight = 64 + 4096  # (of each event)
    del events
    left: list[int] = []  # the events left at each turn of the loop

    def watch() -> None:
        left.append(len(batch.events))
        if batch.events:
            asyncio.get_running_loop().call_soon(watch)

    watch()
    await subscription.let_go(batch)
    assert batch.events == []
    left.append(0)
    freed = [a - b for a, b in itertools.pairwise(left)]
    assert max(freed) * weight <= subscription.FREE_SLICE + weight, freed
    assert len([f for f in freed if f]) > 1  # (in several turns)


async def test_one_large_event_applied_is_freed_a_slice_a_turn() -> None:
    """One event can hold a 4 MB batch's ids (a long prefill's `BlockStored`): it is freed its
    arrays' `FREE_SLICE` ids at a time, not in one go with the event."""
    tokens = 5 * subscription.FREE_SLICE
    batch = KVEventBatch(1.0, [BlockStored(list(range(tokens)), None, list(range(tokens)), 1)])
    left: list[int] = []  # the ids and hashes left at each turn of the loop

    def watch() -> None:
        event = batch.events[0] if batch.events else None
        left.append(0 if event is None else len(event.block_hashes) + len(event.token_ids))
        if batch.events:
            asyncio.get_running_loop().call_soon(watch)

    watch()
    await subscription.let_go(batch)
    assert batch.events == []
    freed = [a - b for a, b in itertools.pairwise([*left, 0])]
    assert max(freed) <= subscription.FREE_SLICE, freed
    assert sum(freed) == 2 * tokens


def _large_history(pub: KvEventPublisher, batches: int) -> None:
    """`batches` batches of ~12 KB each (one block of 4,096 tokens): more than ZMQ's queue and
    the kernel's buffers hold for a peer that reads nothing for a while."""
    tokens = list(range(1000, 5096))
    for i in range(batches):
        pub.record(BlockStored(block_hashes=[i], parent_block_hash=None,
                               token_ids=tokens, block_size=4096))  # fmt: skip
        pub.flush()


def _replay_peer(ctx: zmq.asyncio.Context, endpoint: str, **options: int) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock


async def test_a_replay_waits_for_a_subscriber_whose_queue_is_full_while_another_peer_is_there() -> (
    None
):
    """A replay's send to a subscriber whose queue is full was to wait (for at most
    `REPLAY_SEND_TIMEOUT`), but with any other peer connected to the replay socket the
    socket counts as writable, and pyzmq's send failed at once with EAGAIN: the replay was
    abandoned at the first full queue (a frontend busy applying what it got, while another
    frontend or a relay replayed too), and the subscriber got nothing more until it noticed
    the stall (2 s) and asked again, round after round. Now the send waits, and one replay
    brings the whole history."""
    from shoal.kv.events import END_OF_REPLAY, decode_seq, encode_seq

    pub = KvEventPublisher(buffer=3000)
    await pub.start()
    ctx = zmq.asyncio.Context()
    try:
        _large_history(pub, 3000)
        assert pub.endpoint is not None
        other = _replay_peer(ctx, pub.endpoint.replay)  # another subscriber, its replay done
        await other.send_multipart([b"", encode_seq(2999)])
        assert (await asyncio.wait_for(other.recv_multipart(), 5))[1] == encode_seq(2999)
        assert (await asyncio.wait_for(other.recv_multipart(), 5))[1] == END_OF_REPLAY
        slow = _replay_peer(ctx, pub.endpoint.replay, RCVHWM=1, RCVBUF=4096)
        await slow.send_multipart([b"", encode_seq(0)])
        # (until the replay ends, or waits for the slow one to read: its queue is full)
        await wait_for(lambda: not pub._replays or getattr(pub, "waiting", 0), timeout=5)
        got: list[int] = []
        while True:  # (now it reads: every batch, then the end, from the one replay)
            frames = await asyncio.wait_for(slow.recv_multipart(), 5)
            if frames[1] == END_OF_REPLAY:
                break
            got.append(decode_seq(frames[1]))
        assert got == list(range(3000)), (len(got), got[-1:])
    finally:
        ctx.destroy(linger=0)
        await pub.close()


async def test_replays_to_peers_that_read_nothing_give_way_to_a_new_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A publisher serves `MAX_REPLAYS` replays at once and dropped any request past them,
    and a replay whose peer reads nothing holds its place for `REPLAY_SEND_TIMEOUT` (10 s):
    peers that ask replays and read none of them (as many as the places, asking again) kept
    every frontend's replay unanswered, which the frontend gives up on, dropping the
    worker's blocks. Now a replay whose peer has read nothing for `REPLAY_STALL` gives its
    place to a new request, which is answered at once (`REPLAY_STALL` 0 here: the test need
    not wait for the stalls to age)."""
    from shoal.kv.events import END_OF_REPLAY, encode_seq
    from shoal.worker import kv_publisher

    monkeypatch.setattr(kv_publisher, "MAX_REPLAYS", 2)
    monkeypatch.setattr(kv_publisher, "REPLAY_STALL", 0.0, raising=False)
    pub = KvEventPublisher(buffer=3000)
    await pub.start()
    ctx = zmq.asyncio.Context()
    try:
        _large_history(pub, 3000)
        assert pub.endpoint is not None
        hostile = [_replay_peer(ctx, pub.endpoint.replay, RCVHWM=1, RCVBUF=4096) for _ in "ab"]
        for peer in hostile:  # they ask, and never read
            await peer.send_multipart([b"", encode_seq(0)])
        await wait_for(lambda: pub.waiting == 2, message="both replays wait for their peers")
        good = _replay_peer(ctx, pub.endpoint.replay)
        await good.send_multipart([b"", encode_seq(2998)])
        got = [await asyncio.wait_for(good.recv_multipart(), 5) for _ in range(3)]
        assert [frames[1] for frames in got] == [encode_seq(2998), encode_seq(2999), END_OF_REPLAY]
    finally:
        ctx.destroy(linger=0)
        await pub.close()


def _rss() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_a_peer_subscribing_to_thousands_of_topics_does_not_grow_the_worker() -> None:
    """The PUB socket kept every subscription a peer sent, each at ~45 times its size (its
    tree of prefixes): 2,000 subscriptions of 4 KB (8 MB sent, by anyone who reaches the
    port) grew the worker by ~370 MB, and 20,000 by gigabytes. Now a subscription over
    `PUB_MAX_INBOUND` bytes disconnects its peer, and past `MAX_STRAY_SUBSCRIPTIONS` to
    topics never sent the socket is opened anew on its port (dropping what they cost); a
    subscriber reconnects and gets the batches still."""
    from shoal.kv.events import decode_seq
    from shoal.worker import kv_publisher

    pub = KvEventPublisher()
    endpoint = await pub.start()
    ticking = asyncio.Event()

    async def publish() -> None:  # (a busy engine: the socket reads subscriptions as it sends)
        for i in itertools.count():
            store(pub, i)
            ticking.set()
            await asyncio.sleep(0.005)

    publishing = asyncio.ensure_future(publish())
    ctx = zmq.asyncio.Context()
    try:
        await ticking.wait()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint.publisher)
        await asyncio.wait_for(sub.recv_multipart(), 10)
        before, bound = _rss(), 100 << 20
        large = await raw_subscriptions(
            endpoint.publisher, [i.to_bytes(8, "big") * 500 for i in range(2000)]
        )

        def cut_or_grown() -> bool:  # (the peer disconnected, or the memory grew past)
            return large.transport.is_closing() or _rss() - before > bound

        await wait_for(cut_or_grown, timeout=30)
        grown = _rss() - before
        assert grown < bound, f"the worker grew by {grown >> 20} MiB"
        stray = await raw_subscriptions(
            endpoint.publisher, [i.to_bytes(8, "big") * 16 for i in range(2000)]
        )
        await wait_for(lambda: pub.reopened >= 1, message="the socket was never opened anew")
        assert pub.subscriptions <= kv_publisher.MAX_STRAY_SUBSCRIPTIONS + 3 + 2 * 64
        stray.close()
        seen = decode_seq((await asyncio.wait_for(sub.recv_multipart(), 10))[1])
        later = decode_seq((await asyncio.wait_for(sub.recv_multipart(), 10))[1])
        assert later > seen  # (it reconnected: batches come again)
    finally:
        publishing.cancel()
        ctx.destroy(linger=0)
        await pub.close()
