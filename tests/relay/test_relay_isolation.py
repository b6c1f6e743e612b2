"""One worker's flood of large batches does not hold another's events back, in a `KvRelay`
against a real `nats-server -js` (members fed by hand, as in test_relay_faults): the stream
stores every member's records in one order, so what one member has in flight is bounded in
bytes, not only in records."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shoal.kv import BlockStored, KVEventBatch
from shoal.relay.member import WINDOW, WINDOW_BYTES, Member, Record
from shoal.relay.relay import KvRelay, RelayConfig
from shoal.relay.sender import QUANTUM
from tests.helpers import wait_for
from tests.nats_server import NatsServer
from tests.relay.test_relay_faults import batch, fed

STREAM = "shoal-kv-isolation"


@pytest.fixture
async def relay(nats_server: NatsServer) -> AsyncIterator[KvRelay]:
    made = KvRelay(
        RelayConfig(nats_urls=(nats_server.url,), stream=STREAM, max_bytes=-1, publish_timeout=5)
    )
    await made.start()
    await wait_for(lambda: made.connected.is_set())
    try:
        yield made
    finally:
        await made.stop()


async def test_a_flooding_member_has_a_bounded_number_of_bytes_ahead_of_the_others(
    relay: KvRelay,
) -> None:
    """A member with 60 batches of ~500 KB queued sent them all at once (its window was 128
    records, whatever their size): ~30 MB went before the next record of any other member
    (one member's batch every 10 ms behind a flooding one: 237 ms of lag at the median, 881
    at p99). Its records in flight now hold at most `WINDOW_BYTES` (and one batch), and a
    quiet member's batch is stored while the flood is still being sent."""
    flooder, quiet = fed(relay, 1, buffer=1000), fed(relay, 2, buffer=1000)
    event = BlockStored(list(range(1000)), None, list(range(100_000, 200_000)), 100)
    large = [KVEventBatch(100.0 + seq, [event]) for seq in range(60)]
    most = 0
    stop = asyncio.Event()

    async def watch() -> None:  # every turn of the loop: the flooder's bytes in flight
        nonlocal most
        while not stop.is_set():
            most = max(most, sum(len(r.payload) for r in flooder.inflight))
            await asyncio.sleep(0)

    watching = asyncio.create_task(watch())
    try:
        for seq, one in enumerate(large):
            flooder.apply(seq, one)
        one_batch = len(flooder.pending[-1].payload)
        assert 60 * one_batch > 4 * WINDOW_BYTES and WINDOW > 60  # (the count never bound it)
        await wait_for(lambda: flooder.inflight, message="the flood is being sent")
        quiet.apply(0, batch(100.0))
        await wait_for(lambda: quiet.lag_ms is not None, timeout=20, message="the quiet batch")
        left = len(flooder.pending) + len(flooder.inflight)
        await wait_for(lambda: relay.stats.relayed == 61, timeout=60, message="all stored")
    finally:
        stop.set()
        await watching
    assert most <= WINDOW_BYTES + one_batch, f"{most} bytes in flight"
    assert left > 0, "the quiet member's batch waited for the whole flood"


FLOODERS = 20


def flood(relay: KvRelay, batches: int, tokens: int) -> tuple[list[Member], int]:
    """`FLOODERS` members, each with `batches` batches of `tokens` token ids queued at once;
    returns them and the payload bytes of one batch."""
    event = BlockStored(
        list(range(tokens // 100)), None, list(range(100_000, 100_000 + tokens)), 100
    )
    members = [fed(relay, 100 + i, buffer=1000) for i in range(FLOODERS)]
    for member in members:
        for seq in range(batches):
            member.apply(seq, KVEventBatch(100.0 + seq, [event]))
    return members, len(members[0].pending[-1].payload)


class Sends:
    """Every record a member sends, in order, and the most payload bytes every member of the
    relay had in flight at once (checked after each send)."""

    def __init__(self, relay: KvRelay, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[Member, int]] = []
        self.most_bytes = self.most_records = 0
        real = Member.sent

        def sent(member: Member, record: Record) -> None:
            real(member, record)
            self.log.append((member, len(record.payload)))
            everyone = [*relay.members.values(), *relay._departing]
            self.most_bytes = max(self.most_bytes, sum(m.flying for m in everyone))
            self.most_records = max(self.most_records, sum(len(m.inflight) for m in everyone))

        monkeypatch.setattr(Member, "sent", sent)


async def test_a_quiet_member_waits_at_most_one_round_behind_twenty_flooding_members(
    relay: KvRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 members flooding 256 KB batches each had 4 MiB in flight: a quiet member's batch was
    sent behind ~80 MB of theirs, which the stream stores first (p99 about 1 s). The relay's
    records in flight are now bounded for all members together (`inflight_bytes`), and the
    members with records to send take turns (`QUANTUM` bytes, at least one record): a quiet
    member's batch has at most the budget and one round of the others' turns ahead of it,
    flood or not."""
    sends = Sends(relay, monkeypatch)
    flooders, one_batch = flood(relay, batches=16, tokens=50_000)
    quiet = fed(relay, 1, buffer=1000)
    await wait_for(lambda: sum(m.flying for m in flooders) > 0, message="the flood is sent")
    ahead: list[int] = []
    waited: list[float] = []
    loop = asyncio.get_running_loop()
    seq = 0
    while any(m.pending or m.inflight for m in flooders) and seq < 50:
        before, flying = len(sends.log), sum(m.flying for m in flooders)
        started = loop.time()
        quiet.apply(seq, batch(100.0 + seq))
        await wait_for(lambda: not quiet.pending and not quiet.inflight, timeout=30)
        waited.append(loop.time() - started)
        after = sends.log[before:]
        mine = next(i for i, (member, _) in enumerate(after) if member is quiet)
        ahead.append(flying + sum(size for _, size in after[:mine]))
        seq += 1
    await wait_for(lambda: relay.stats.relayed == FLOODERS * 16 + seq, timeout=60)
    assert len(ahead) >= 3, (
        f"the flood was over before the quiet member sent 3 batches: {ahead} {waited}"
    )
    bound = relay.config.inflight_bytes + FLOODERS * max(one_batch, QUANTUM)
    assert max(ahead) <= bound, (
        f"{max(ahead) / 2**20:.1f} MiB of the flood sent before a quiet batch "
        f"(bound {bound / 2**20:.1f} MiB); waited {max(waited) * 1000:.0f} ms at most"
    )


async def test_the_relay_never_has_more_than_its_budget_in_flight(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every member may have 128 records and 4 MiB in flight: 20 flooding members had ~80 MB
    in flight at once. The relay as a whole now has at most `inflight_bytes` of payload and
    `inflight_records` records in flight, and every record is still stored."""
    relay = KvRelay(
        RelayConfig(
            nats_urls=(nats_server.url,), stream=STREAM, max_bytes=-1, publish_timeout=5,
            inflight_bytes=2 << 20, inflight_records=64,
        )
    )  # fmt: skip
    await relay.start()
    try:
        await wait_for(lambda: relay.connected.is_set())
        sends = Sends(relay, monkeypatch)
        _, one_batch = flood(relay, batches=8, tokens=30_000)
        assert FLOODERS * 8 * one_batch > 8 * relay.config.inflight_bytes
        small = [fed(relay, 200 + i, buffer=1000) for i in range(20)]  # many tiny records
        for member in small:
            for seq in range(20):
                member.apply(seq, batch(100.0 + seq))
        await wait_for(lambda: relay.stats.relayed == FLOODERS * 8 + 20 * 20, timeout=60)
    finally:
        await relay.stop()
    assert 0 < sends.most_bytes <= 2 << 20, f"{sends.most_bytes} bytes in flight at once"
    assert 0 < sends.most_records <= 64, f"{sends.most_records} records in flight at once"
