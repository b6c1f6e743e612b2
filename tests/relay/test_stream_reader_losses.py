"""`KvStreamReader` against a real `nats-server -js`: records the stream no longer holds when
the reader gets to them (retention, a purge) are a loss, wherever the reader is: what it holds
of the instances is dropped, not routed on."""

from __future__ import annotations

from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client

from shoal.frontend.kv import kept
from shoal.frontend.kv import stream as kv_stream
from shoal.frontend.kv.stream import KvStreamReader
from shoal.kv import AllBlocksCleared, KVEventBatch, encode_batch
from shoal.kv import stream as layout
from tests.helpers import LoopTurns, wait_for
from tests.nats_server import NatsServer

STREAM = "shoal-kv-losses"


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url)
    await client.jetstream().add_stream(name=STREAM, subjects=[f"{layout.SUBJECT_PREFIX}.>"])
    yield client
    await client.close()


async def publish(nc: Client, instance_id: int, seq: int) -> None:
    ts = 100.0 + seq
    headers = {layout.KIND: layout.BATCH, layout.SEQ: str(seq), layout.TS: repr(ts)}
    await nc.jetstream().publish(
        layout.subject("ns", instance_id),
        encode_batch(KVEventBatch(ts, [AllBlocksCleared()])),
        headers=headers,
    )


async def test_records_removed_before_a_reader_read_them_drop_what_it_holds(
    nats_server: NatsServer, nc: Client
) -> None:
    """The reader read record 1 (instance 1's batch 0); its consumer is lost (a server
    restarted, a consumer deleted) and records 2 (instance 1's batch 1: evictions, say) is
    removed before it reads again (retention). Its ordered consumer starts again at the first
    record there is, 3: record 2 is lost, and the reader drops instance 1's blocks rather than
    keep what batch 1 evicted."""
    reader = KvStreamReader(nats_server.url, STREAM)
    applied: list[float] = []
    purges: list[int] = []
    reader.follow(("ns", 1), lambda b: applied.append(b.ts), lambda: purges.append(1))
    reader.start()
    try:
        await publish(nc, 1, 0)
        await wait_for(lambda: applied == [100.0], message="batch 0 applied")
        js = nc.jetstream()
        for consumer in await js.consumers_info(STREAM):
            await js.delete_consumer(STREAM, consumer.name)
        await publish(nc, 1, 1)  # record 2
        await publish(nc, 2, 0)  # record 3 (another instance)
        await js.purge_stream(STREAM, seq=3)  # records before 3 are gone
        await wait_for(lambda: reader.describe()["last_record"] == 3, timeout=20)
        assert applied == [100.0]
        assert purges, "instance 1's blocks kept though its batch 1 was never read"
    finally:
        await reader.close()


async def test_a_loss_drops_a_full_ledger_a_slice_per_turn_of_the_loop(
    nats_server: NatsServer, nc: Client
) -> None:
    """A loss of records drops every instance's kept batches: at the 64 MiB bound of tiny
    batches (~285,000) that was one step of the loop, 23 ms of it (53 ms once each batch
    leaves the ledger's order as it goes). It is now done `LOSE_SLICE` batches a turn."""
    reader = KvStreamReader(nats_server.url, STREAM)
    for instance_id in range(100, 130):  # 30 instances not followed, 4,096 batches kept each
        subject = layout.subject("other", instance_id)
        for seq in range(4096):
            headers = {layout.KIND: layout.BATCH, layout.SEQ: str(seq), layout.TS: f"{seq}.0"}
            reader.record(subject, headers, encode_batch(KVEventBatch(float(seq), [])))
    assert reader.ledger.live == 30 * 4096
    applied: list[float] = []
    reader.follow(("ns", 1), lambda b: applied.append(b.ts), lambda: None)
    turns = LoopTurns().wrap(kept.Ledger, "gone")
    reader.start()
    try:
        await publish(nc, 1, 0)
        await wait_for(lambda: applied == [100.0], message="batch 0 applied")
        js = nc.jetstream()
        for consumer in await js.consumers_info(STREAM):
            await js.delete_consumer(STREAM, consumer.name)
        await publish(nc, 1, 1)
        await publish(nc, 2, 0)
        await js.purge_stream(STREAM, seq=3)  # record 2 is gone: a loss
        await wait_for(lambda: reader.describe()["last_record"] == 3, timeout=20)
        assert reader.ledger.live == 1  # (record 3: instance 2, not followed)
    finally:
        await turns.stop()
        await reader.close()
    assert turns.on_loop == 30 * 4096
    assert turns.most_per_turn <= 2 * kv_stream.LOSE_SLICE, turns.most_per_turn


async def test_records_nats_py_drops_for_a_slow_reader_are_read_again_from_the_stream(
    nats_server: NatsServer,
    nc: Client,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """nats-py queued up to 524,288 records (256 MiB) for the reader, whatever the reader's
    own budget (64 MiB kept); past its limits it drops records and calls the error callback
    (`SlowConsumerError`), which the reader only logged: the instance's index went on
    without the dropped batches (its evictions kept for good), nothing dropped. Now the
    subscription's limits are the reader's (`READ_AHEAD_MSGS`, here 16), a drop is counted
    and logged, and the reader reads the stream again from the first record dropped: every
    batch applied once, in order, no loss."""
    monkeypatch.setattr(kv_stream, "READ_AHEAD_MSGS", 16, raising=False)
    for seq in range(2000):  # one burst when the reader starts: far more than 16 at once
        await publish(nc, 1, seq)
    reader = KvStreamReader(nats_server.url, STREAM)
    applied: list[float] = []
    purges: list[int] = []
    reader.follow(("ns", 1), lambda b: applied.append(b.ts), lambda: purges.append(1))
    reader.start()
    try:
        await wait_for(lambda: reader.describe()["last_record"] == 2000, timeout=60)
    finally:
        await reader.close()
    assert reader.stats.stream_drops > 0, "no record dropped: the queue was not bounded"
    assert applied == [100.0 + seq for seq in range(2000)]
    assert not purges and reader.stats.resnapshots == 0
    assert any("slow" in r.getMessage() and "read again" in r.getMessage() for r in caplog.records)
