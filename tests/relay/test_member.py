"""`Member`, the relay's queue of one instance's records, one unit: a full queue turns its
batches into one `resnapshot`, a publisher restart starts a new epoch, and a relay that joins
a run late takes the stream's epoch only when the run is the same."""

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
    assert {r.epoch for r in m.pending} == {layout.epoch_of(100.0)}  # still batch 0's run


def test_a_publisher_restart_starts_a_new_epoch_after_a_resnapshot() -> None:
    m = member()
    for seq in range(3):
        m.apply(seq, batch(100.0 + seq))
    m.resnapshot()  # what the subscription calls when the numbering starts again
    m.apply(0, batch(200.0))
    kinds = queued(m)
    assert kinds[-2:] == [("resnapshot", 0), ("batch", 0)]
    assert m.pending[-1].epoch == layout.epoch_of(200.0) != m.pending[0].epoch


def test_a_late_relay_takes_the_streams_epoch_only_for_the_same_run() -> None:
    same = member()
    same.hint = ("e-stream", 40, 140.0)  # the other relay is at batch 40 of this run
    same.apply(50, batch(150.0))
    same.resolve_epoch(same.pending[0])
    assert same.pending[0].epoch == same.epoch == "e-stream"

    ahead = member()
    ahead.hint = ("e-stream", 60, 160.0)  # the other relay is ahead in this run
    ahead.apply(50, batch(150.0))
    ahead.resolve_epoch(ahead.pending[0])
    assert ahead.epoch == "e-stream"

    old = member()
    old.hint = ("e-old", 900, 90.0)  # a run that ended: numbered higher, stamped earlier
    old.apply(50, batch(150.0))
    old.resolve_epoch(old.pending[0])
    assert old.epoch == layout.epoch_of(150.0)
