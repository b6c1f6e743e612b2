"""`Member`, the relay's queue of one instance's records: a full queue holds its subscription
back (the worker keeps what is not read), past its bound it turns its batches into one
`resnapshot`, a publisher restart queues one, and a batch's message id is the same from every
relay whenever it joined (the worker's numbering and timestamp)."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from shoal.kv import AllBlocksCleared, KvEndpoint, KVEventBatch, encode_batch
from shoal.kv import stream as layout
from shoal.kv.subscription import KvSubscription
from shoal.relay.member import STORED, WINDOW, Member, RelayStats
from tests.helpers import wait_for
from tests.kv.fake_vllm import FakeVllmPublisher


def member(buffer: int = 100) -> Member:
    joined = layout.Joined(4, "m", "ns", "c", "e", "aggregated", "x")
    endpoint = KvEndpoint("tcp://127.0.0.1:1")
    return Member(("ns", 1), layout.subject("ns", 1), endpoint, joined, RelayStats(), buffer)


def batch(ts: float) -> KVEventBatch:
    return KVEventBatch(ts, [AllBlocksCleared()])


def queued(m: Member) -> list[tuple[str, int]]:
    return [(r.kind, r.seq) for r in m.pending]


def test_a_queue_past_its_buffer_and_a_window_drops_its_batches_for_one_resnapshot() -> None:
    m = member(buffer=3)
    bound = 3 + WINDOW  # (a subscription waiting for room never gets there)
    for seq in range(bound + 2):
        m.apply(seq, batch(100.0 + seq))  # never blocks
    assert queued(m) == [("resnapshot", bound), ("batch", bound), ("batch", bound + 1)]
    assert (m.stats.dropped, m.stats.resnapshots) == (bound, 1)


async def test_a_full_queue_holds_the_subscription_back_and_the_worker_keeps_the_rest() -> None:
    publisher = FakeVllmPublisher()
    ctx = zmq.asyncio.Context()
    m = member(buffer=4)
    endpoint = KvEndpoint(publisher.endpoint, publisher.replay_endpoint)
    sub = KvSubscription(
        ctx, 1, endpoint, m.apply, m.resnapshot, m.stats.subscriptions,
        whole_batches=True, room=m.room,
    )  # fmt: skip
    try:
        sub.start()
        await wait_for(lambda: 0 in publisher.replay_requests, message="subscribed")
        for seq in range(20):  # NATS down: nothing leaves the queue
            # 5-14 overflow the socket's queue (as past its high-water mark): replay only.
            live = not 5 <= seq < 15
            await publisher.send(seq, encode_batch(batch(100.0 + seq)), live=live)
        await wait_for(lambda: len(m.pending) == 3, message="the queue filled (4: room for 2)")
        sent: list[tuple[str, int]] = []

        def drained() -> bool:  # NATS back: the sender takes records as they come
            while m.pending:
                record = m.pending.popleft()
                sent.append((record.kind, record.seq))
            m.taken()
            return bool(sent) and sent[-1] == ("batch", 19)

        await wait_for(drained, message="every batch queued in the end")
        assert sent == [("batch", seq) for seq in range(20)]  # in order, none lost
        assert 5 in publisher.replay_requests  # the gap read from the worker's buffer
        assert (m.stats.dropped, m.stats.resnapshots, m.stats.subscriptions.resnapshots) == (
            0,
            0,
            0,
        )
    finally:
        await sub.stop()
        await publisher.close()
        ctx.destroy(linger=0)


def test_a_publisher_restart_queues_a_resnapshot_before_its_first_batch() -> None:
    m = member()
    for seq in range(3):
        m.apply(seq, batch(100.0 + seq))
    m.resnapshot()  # what the subscription calls when the numbering starts again
    m.apply(0, batch(200.0))
    assert queued(m)[-2:] == [("resnapshot", 0), ("batch", 0)]
    assert ids(m)[0] != m.pending[0].headers(m)[layout.MSG_ID]  # not batch 0 of the first run


def ids(m: Member) -> dict[int, str]:
    """Seq -> message id of the batches queued."""
    return {r.seq: r.headers(m)[layout.MSG_ID] for r in m.pending if r.kind == layout.BATCH}


def test_two_relays_that_joined_a_run_at_different_points_give_each_batch_the_same_id() -> None:
    early, late = member(), member()
    for seq in range(10):
        early.apply(seq, batch(100.0 + seq))
    for seq in range(6, 10):  # joined when batch 0 had left the worker's buffer
        late.apply(seq, batch(100.0 + seq))
    assert ids(late) == {seq: ids(early)[seq] for seq in range(6, 10)}
    # Another relay joining later still, while nobody holds batch 6 anymore: the same ids.
    later = member()
    later.apply(9, batch(109.0))
    assert ids(later) == {9: ids(early)[9]}


def test_a_restarted_publishers_batch_of_the_same_number_has_another_id() -> None:
    before, after = member(), member()
    before.apply(3, batch(103.0))
    after.apply(3, batch(203.0))  # a new run, numbered from 0 again, reached 3
    assert ids(before)[3] != ids(after)[3]


async def test_the_records_queued_by_every_member_are_bounded_in_bytes() -> None:
    """While NATS takes nothing, the bytes all of a relay's members hold stay under its byte
    bound (plus one batch a member): past it their subscriptions wait, and go on (nothing
    dropped) as acknowledgements free bytes."""
    stats = RelayStats()
    joined = layout.Joined(4, "m", "ns", "c", "e", "aggregated", "x")
    endpoint = KvEndpoint("tcp://127.0.0.1:1")
    members = [
        Member(("ns", i), layout.subject("ns", i), endpoint, joined, stats, 10_000, 2_000_000)
        for i in range(3)
    ]
    big = KVEventBatch(100.0, [AllBlocksCleared()] * 20_000)  # ~360 KB

    async def feed(m: Member) -> None:  # what a subscription does
        for seq in range(40):
            await m.room()
            m.apply(seq, big)
            held = sum(len(r.payload) for each in members for r in each.pending)
            assert held == stats.queued_bytes <= 2_000_000 + 3 * 400_000

    feeders = [asyncio.create_task(feed(m)) for m in members]
    await wait_for(lambda: stats.short == set(members), message="every member waits for bytes")
    assert stats.queued_bytes <= 2_000_000 + 3 * 400_000

    def acknowledge_all() -> bool:  # NATS takes records again
        for m in members:
            while m.pending:
                record = m.pending.popleft()
                m.inflight.append(record)
                m.acknowledged(record, STORED)
        return all(f.done() for f in feeders)

    await wait_for(acknowledge_all, message="every batch queued in the end")
    for f in feeders:
        f.result()
    assert stats.queued_bytes == 0 and stats.dropped == 0 and stats.resnapshots == 0


async def test_one_members_backlog_never_holds_a_member_with_nothing_queued() -> None:
    """The byte bound is shared by every member: one worker flooding large batches held all
    of it, and every other member's subscription waited for it to drain (in a relay with
    real NATS, a member sending a small batch every 10 ms while another floods 500 KB
    batches had 240 of its 926 batches taken in 10 s, its lag 237 ms at the median, 881 ms
    at p99, against 2 and 5 alone). A member with nothing queued or in flight now takes a
    batch whatever the others hold (the bound still holds, plus a batch a member)."""
    stats = RelayStats()
    joined = layout.Joined(4, "m", "ns", "c", "e", "aggregated", "x")
    endpoint = KvEndpoint("tcp://127.0.0.1:1")
    flooder, quiet = (
        Member(("ns", i), layout.subject("ns", i), endpoint, joined, stats, 10_000, 2_000_000)
        for i in (1, 2)
    )
    big = KVEventBatch(100.0, [AllBlocksCleared()] * 20_000)  # ~360 KB

    async def flood() -> None:
        for seq in range(100):
            await flooder.room()
            flooder.apply(seq, big)

    flooding = asyncio.create_task(flood())
    try:
        await wait_for(lambda: flooder in stats.short, message="the flooder holds the bound")
        for seq in range(3):
            async with asyncio.timeout(1):
                await quiet.room()  # (nothing of it queued: never held by the flooder)
            quiet.apply(seq, batch(100.0 + seq))
            record = quiet.pending.popleft()  # sent, and acknowledged
            quiet.inflight.append(record)
            quiet.acknowledged(record, STORED)
        quiet.apply(3, batch(103.0))  # one queued: it waits like any other now
        waiting = asyncio.create_task(quiet.room())
        await wait_for(lambda: quiet in stats.short, message="a member with a batch queued waits")
        assert not waiting.done()
        record = quiet.pending.popleft()
        quiet.inflight.append(record)
        quiet.acknowledged(record, STORED)  # its queue empty again: it goes on
        async with asyncio.timeout(1):
            await waiting
        assert stats.queued_bytes <= 2_000_000 + 2 * 400_000
    finally:
        flooding.cancel()


def test_a_batch_applied_after_the_member_left_is_not_queued_after_its_left() -> None:
    """The relay stops a leaving member's subscription in a task of its own: a subscription
    resuming in the same turn of the loop (a large batch decoded a slice a turn) still
    applied its batch, queued after `left`, and readers took it for a new run of the
    instance (`left` reset: its entry kept). `left` is now the run's last record."""
    m = member()
    m.apply(0, batch(100.0))
    m.leave()
    m.apply(1, batch(101.0))  # (the subscription, not cancelled yet)
    m.resnapshot()
    m.apply(2, batch(102.0))
    assert queued(m) == [("batch", 0), ("left", 0)]
