"""`Member`, the relay's queue of one instance's records, one unit: a full queue turns its
batches into one `resnapshot`, a publisher restart queues one, and a batch's message id is
the same from every relay whenever it joined (the worker's numbering and timestamp)."""

from __future__ import annotations

from shoal.kv import AllBlocksCleared, KvEndpoint, KVEventBatch
from shoal.kv import stream as layout
from shoal.relay.member import Member, RelayStats


def member(buffer: int = 100) -> Member:
    joined = layout.Joined(4, "m", "ns", "c", "e", "aggregated", "x")
    endpoint = KvEndpoint("tcp://127.0.0.1:1")
    return Member(("ns", 1), layout.subject("ns", 1), endpoint, joined, RelayStats(), buffer)


def batch(ts: float) -> KVEventBatch:
    return KVEventBatch(ts, [AllBlocksCleared()])


def queued(m: Member) -> list[tuple[str, int]]:
    return [(r.kind, r.seq) for r in m.pending]


def test_a_full_queue_drops_its_batches_for_one_resnapshot_and_never_blocks() -> None:
    m = member(buffer=3)
    for seq in range(5):
        m.apply(seq, batch(100.0 + seq))
    assert queued(m) == [("resnapshot", 3), ("batch", 3), ("batch", 4)]
    assert (m.stats.dropped, m.stats.resnapshots) == (3, 1)


def test_a_publisher_restart_queues_a_resnapshot_before_its_first_batch() -> None:
    m = member()
    for seq in range(3):
        m.apply(seq, batch(100.0 + seq))
    m.resnapshot()  # what the subscription calls when the numbering starts again
    m.apply(0, batch(200.0))
    assert queued(m)[-2:] == [("resnapshot", 0), ("batch", 0)]
    assert ids(m)[0] != m.pending[0].headers(1)[layout.MSG_ID]  # not batch 0 of the first run


def ids(m: Member) -> dict[int, str]:
    """Seq -> message id of the batches queued."""
    return {
        r.seq: r.headers(m.instance_id)[layout.MSG_ID] for r in m.pending if r.kind == layout.BATCH
    }


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
