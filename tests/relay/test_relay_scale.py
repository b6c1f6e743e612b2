"""`KvRelay.on_view` with a membership of 10,000 instances (one a namespace): joining them all,
and leaving them all, never holds the event loop more than a few milliseconds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from shoal.kv import KvEndpoint
from shoal.relay.relay import KvRelay, RelayConfig
from tests.helpers import wait_for
from tests.kv.probes import LoopProbe

MEMBERS = 10_000


def view(count: int) -> Any:
    """A membership view of `count` endpoints, one namespace each, each with a KV publisher
    (that is not there: each subscription waits, idle)."""
    endpoints = {}
    for i in range(count):
        card = SimpleNamespace(
            kv_block_size=4, display_name="m", role="aggregated", mdcsum="x", lora=None
        )
        kv = KvEndpoint("tcp://127.0.0.1:1")
        instance = SimpleNamespace(namespace=f"ns{i}", component="c", endpoint="e", kv_events=kv)
        model = SimpleNamespace(card=card, instance=instance)
        endpoints[i] = SimpleNamespace(namespace=f"ns{i}", instance_id=i + 1, models=(model,))
    return SimpleNamespace(endpoints=endpoints, connection_revision=None)


async def test_a_view_of_ten_thousand_members_joins_and_leaves_without_holding_the_loop() -> None:
    relay = KvRelay(RelayConfig(nats_urls=("nats://127.0.0.1:1",)))  # (NATS never answers)
    await relay.start()
    full, empty = view(MEMBERS), view(0)
    probe = LoopProbe()
    try:
        relay.on_view(full)
        await wait_for(lambda: len(relay.members) == MEMBERS, timeout=60, message="all joined")
        relay.on_view(empty)
        await wait_for(lambda: not relay.members and not relay._leaving, timeout=60)
        held = await probe.stop()
    finally:
        await relay.stop()
    assert held < 0.02, f"the event loop was held {held * 1000:.0f} ms"
