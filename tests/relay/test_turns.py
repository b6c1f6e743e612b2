"""`Turns`, the order in which the relay's members send: a turn each, `QUANTUM` bytes of
records at least one, within the relay's budget of records in flight; members that cannot
send leave their turn, `SKIPS` at most per look."""

from __future__ import annotations

from shoal.kv import KvEndpoint
from shoal.kv import stream as layout
from shoal.relay.member import Member, Record, RelayStats
from shoal.relay.sender import QUANTUM, SKIPS, Turns


def members(stats: RelayStats, count: int, size: int, records: int = 3) -> list[Member]:
    joined = layout.Joined(4, "m", "ns", "c", "e", "aggregated", "x")
    made = []
    for i in range(count):
        key = ("ns", i + 1)
        member = Member(key, layout.subject(*key), KvEndpoint("tcp://127.0.0.1:1"), joined,
                        stats, 100)  # fmt: skip
        member.pending.extend(Record(layout.BATCH, seq, 1.0, b"x" * size) for seq in range(records))
        made.append(member)
    return made


def serve(turns: Turns, most: int) -> list[int]:
    """The members served, in order (their instance ids), each record sent as it is."""
    served = []
    while len(served) < most and (member := turns.next(0.0)) is not None:
        record = member.pending[0]
        member.sent(record)
        turns.served(member, len(record.payload), 0.0)
        served.append(member.instance_id)
    return served


def test_a_member_that_came_last_is_served_after_one_turn_of_each_other() -> None:
    stats = RelayStats()
    turns = Turns(stats, max_bytes=1 << 30, max_records=10_000)
    flooders = members(stats, 20, QUANTUM)  # one record fills a turn
    for member in flooders:
        turns.add(member)
    assert serve(turns, 5) == [1, 2, 3, 4, 5]
    (quiet,) = members(stats, 1, 10, records=50)  # small records: all in one turn
    quiet.key = ("ns", 99)
    turns.add(quiet)
    # (1-5 were served and back in line before it came: a turn of each other member)
    assert serve(turns, 20 + 50) == list(range(6, 21)) + [1, 2, 3, 4, 5] + [99] * 50


def test_the_budget_holds_every_member_and_a_large_record_goes_alone() -> None:
    stats = RelayStats()
    turns = Turns(stats, max_bytes=1000, max_records=4)
    for member in members(stats, 4, 300, records=1):
        turns.add(member)
    assert serve(turns, 100) == [1, 2, 3]  # (a fourth would pass 1,000 bytes)
    assert stats.starved and stats.flying == 900
    counted = RelayStats()
    few = Turns(counted, max_bytes=1 << 30, max_records=4)
    for member in members(counted, 6, 10, records=1):
        few.add(member)
    assert serve(few, 100) == [1, 2, 3, 4] and counted.starved  # (4 records in flight)
    big = members(RelayStats(), 1, 5000)[0]
    alone = Turns(big.stats, max_bytes=1000)
    alone.add(big)
    assert serve(alone, 100) == [1]  # (nothing else in flight: it goes, alone)


def test_members_that_cannot_send_leave_their_turns_a_slice_at_a_time() -> None:
    """20,000 members failed at once (a lost connection) left their turns in one call: ~10 ms
    of the loop. `SKIPS` a call now; the sender yields between calls."""
    stats = RelayStats()
    turns = Turns(stats)
    failed = members(stats, 20_000, 10, records=1)
    for member in failed:
        turns.add(member)
        member.failed = "the connection was lost"
    calls = 0
    while True:
        before = len(turns.order)
        assert turns.next(0.0) is None
        assert before - len(turns.order) <= SKIPS
        calls += 1
        if not turns.cut:
            break
    assert not turns.order and calls == 20_000 // SKIPS + 1
