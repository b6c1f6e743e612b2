"""One worker's flood of large batches does not hold another's events back, in a `KvRelay`
against a real `nats-server -js` (members fed by hand, as in test_relay_faults): the stream
stores every member's records in one order, so what one member has in flight is bounded in
bytes, not only in records."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shoal.kv import BlockStored, KVEventBatch
from shoal.relay.member import WINDOW, WINDOW_BYTES
from shoal.relay.relay import KvRelay, RelayConfig
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
