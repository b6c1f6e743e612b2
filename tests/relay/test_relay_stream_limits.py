"""`KvRelay` against a stream made by someone else with limits of its own (a real
`nats-server -js`): a record the stream refuses for good, a stream that refuses every record."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats
import pytest
from nats.js import api

from shoal.kv import BlockStored, KvEndpoint, KVEventBatch
from shoal.kv import stream as layout
from shoal.membership import MembershipStatus
from shoal.relay.member import Member
from shoal.relay.relay import KvRelay, RelayConfig
from shoal.relay.status import StatusServer
from tests.helpers import wait_for
from tests.nats_server import NatsServer
from tests.relay import test_relay_faults as relay_faults
from tests.relay.test_relay_faults import batch

STREAM = "shoal-kv-limits"


async def make_stream(url: str, **limits: object) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(
            name=STREAM, subjects=[f"{layout.SUBJECT_PREFIX}.>"], **limits
        )
    finally:
        await nc.close()


async def kinds(url: str) -> list[tuple[str, str]]:
    """(kind, Shoal-Seq) of every record in the stream, in its order."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(STREAM)
        sub = await js.subscribe(f"{layout.SUBJECT_PREFIX}.>", stream=STREAM, ordered_consumer=True)
        got = []
        for _ in range(info.state.messages):
            msg = await sub.next_msg(timeout=5)
            headers = msg.headers or {}
            got.append((headers.get(layout.KIND, ""), headers.get(layout.SEQ, "")))
        return got
    finally:
        await nc.close()


@pytest.fixture
async def relay(nats_server: NatsServer) -> AsyncIterator[KvRelay]:
    made = KvRelay(RelayConfig(nats_urls=(nats_server.url,), stream=STREAM, publish_timeout=1))
    yield made
    await made.stop()


def fed(relay: KvRelay, instance_id: int) -> Member:
    """`test_relay_faults.fed`, the relay's buffer as configured."""
    return relay_faults.fed(relay, instance_id, buffer=None)


def large(ts: float, blocks: int = 64) -> KVEventBatch:
    return KVEventBatch(ts, [BlockStored(list(range(blocks)), None, [7] * (4 * blocks), 4)])


async def test_a_batch_over_the_streams_max_message_size_is_a_resnapshot_not_a_stuck_member(
    relay: KvRelay, nats_server: NatsServer
) -> None:
    """The stream (made by an operator) takes messages of 256 bytes at most: a batch larger
    than that is refused for good. The member publishes a resnapshot in its place and goes
    on with its next batches; another member is not held either."""
    await make_stream(nats_server.url, max_msg_size=256)
    await relay.start()
    member, other = fed(relay, 1), fed(relay, 2)
    member.apply(0, batch(100.0))
    member.apply(1, large(101.0))
    member.apply(2, batch(102.0))
    other.apply(0, batch(100.0))

    def done() -> bool:
        return not (member.pending or member.inflight or other.pending or other.inflight)

    await wait_for(done, timeout=10, message="every record answered, none left to send")
    records = await kinds(nats_server.url)
    mine = [r for r in records if r[0] != layout.JOINED]
    assert ("resnapshot", "2") in mine and ("batch", "2") in mine, records
    assert ("batch", "1") not in mine
    assert relay.stats.dropped == 1 and relay.stats.resnapshots == 1


async def test_health_says_so_while_the_stream_refuses_every_record(
    relay: KvRelay, nats_server: NatsServer
) -> None:
    """A stream full with `discard: new` refuses every record: NATS is connected but takes
    nothing, and `/health` says so (503) instead of 200."""
    await make_stream(nats_server.url, max_msgs=2, discard=api.DiscardPolicy.NEW)
    await relay.start()
    watch = SimpleNamespace(status=MembershipStatus(applied_revision="r1"))
    status = StatusServer(relay, watch)  # type: ignore[arg-type]
    member = fed(relay, 1)  # its joined: the first message
    member.apply(0, batch(100.0))  # the second: the stream is full now
    await wait_for(lambda: relay.stats.relayed == 1, timeout=10)
    assert status.health()[0] == 200
    member.apply(1, batch(101.0))  # refused, and refused again
    await wait_for(lambda: relay.stats.publish_errors >= 1, timeout=10)

    def unhealthy() -> bool:
        code, body = status.health()
        return code == 503 and "maximum messages exceeded" in str(body)

    await wait_for(unhealthy, timeout=10, message="health tells the stream refuses records")
    nc = await nats.connect(nats_server.url)
    try:
        await nc.jetstream().purge_stream(STREAM)  # room again: the record goes in
    finally:
        await nc.close()
    await wait_for(lambda: relay.stats.relayed == 2, timeout=15)
    await wait_for(lambda: status.health()[0] == 200, timeout=10, message="healthy again")


def view_of(connection_revision: str) -> Any:
    """A membership view holding instance 1 of "ns" (its publisher is not there: idle)."""
    card = SimpleNamespace(
        kv_block_size=4, display_name="m", role="aggregated", mdcsum="x", lora=None
    )
    kv = KvEndpoint("tcp://127.0.0.1:1")
    instance = SimpleNamespace(namespace="ns", component="c", endpoint="e", kv_events=kv)
    endpoint = SimpleNamespace(
        namespace="ns", instance_id=1, models=(SimpleNamespace(card=card, instance=instance),)
    )
    return SimpleNamespace(endpoints={1: endpoint}, connection_revision=connection_revision)


async def test_a_new_connection_revision_that_cannot_connect_keeps_the_connection_in_use(
    relay: KvRelay, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Make before break: a sources file's new `connection_revision` has the relay connect
    again (its credentials read again). While the new connection cannot be made (the
    credentials file is not there yet), the one in use keeps relaying, and the status says
    why the new one is not made."""
    await make_stream(nats_server.url)
    await relay.start()
    relay.on_view(view_of("c1"))
    await wait_for(lambda: ("ns", 1) in relay.members and relay.connected.is_set())
    member = relay.members[("ns", 1)]
    member.apply(0, batch(100.0))
    await wait_for(lambda: relay.stats.relayed == 1, timeout=10)
    relay.config.creds = tmp_path / "rotated.creds"  # (not written yet)
    relay.on_view(view_of("c2"))
    await wait_for(lambda: "cannot connect" in str(relay.nats_error), message="the attempt told")
    member.apply(1, batch(101.0))
    await wait_for(lambda: relay.stats.relayed == 2, timeout=10, message="the old one relays")
    assert relay.connected.is_set() and relay.connections == 1
