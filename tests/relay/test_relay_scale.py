"""A relay following 10,000 instances (one a namespace): joining them all, leaving them all and
its `/metrics` never hold the event loop more than a few milliseconds: counted as the members
joined or left, and statuses listed, per turn of the loop, and where `/metrics` is rendered."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest

from shoal.kv import KvEndpoint
from shoal.relay import status as relay_status
from shoal.relay.member import Member
from shoal.relay.relay import (
    CHANGES_PER_TURN,
    STATUS_MEMBERS,
    KvRelay,
    RelayConfig,
    member_cursor,
    parse_member_cursor,
)
from shoal.relay.status import StatusServer
from tests.helpers import LoopTurns, wait_for

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
    changes = LoopTurns().wrap(relay, "_join").wrap(relay, "_leave")
    try:
        relay.on_view(full)
        await wait_for(lambda: len(relay.members) == MEMBERS, timeout=60, message="all joined")
        relay.on_view(empty)
        await wait_for(lambda: not relay.members and not relay._leaving, timeout=60)
    finally:
        await changes.stop()
        await relay.stop()
    assert changes.on_loop == 2 * MEMBERS
    most = changes.most_per_turn
    assert most <= CHANGES_PER_TURN, f"{most} members joined or left in one turn of the loop"


async def test_metrics_of_ten_thousand_members_are_rendered_without_holding_the_loop() -> None:
    """`/metrics` carries a lag per member: rendering 10,000 of them (each scrape) is not
    done on the event loop."""
    relay = KvRelay(RelayConfig(nats_urls=("nats://127.0.0.1:1",)))
    await relay.start()
    relay.on_view(view(MEMBERS))
    await wait_for(lambda: len(relay.members) == MEMBERS, timeout=60)
    for member in relay.members.values():
        member.lag_ms = 12.5
    status = StatusServer(relay, SimpleNamespace())  # type: ignore[arg-type]
    await status.start("127.0.0.1", 0)
    url = f"{status.url}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return str(resp.read().decode())

    rendered = LoopTurns().wrap(relay_status, "_render")
    try:
        body = await asyncio.to_thread(scrape)  # (the client in a thread: not on the loop)
    finally:
        await rendered.stop()
        await status.stop()
        await relay.stop()
    assert body.count("shoal_relay_lag_ms{") == MEMBERS
    assert rendered.on_loop == 0 and rendered.off_loop == 1  # rendered in a thread


async def test_the_status_of_ten_thousand_members_is_paged_without_holding_the_loop() -> None:
    """`/v1/membership/status` listed every member, sorted, at each request: 14 ms of the
    loop at 10,000, twice that at 20,000. Now a page of at most 1,000 (`?limit`), the next
    after `?after`."""
    relay = KvRelay(RelayConfig(nats_urls=("nats://127.0.0.1:1",)))
    await relay.start()
    relay.on_view(view(MEMBERS))
    await wait_for(lambda: len(relay.members) == MEMBERS, timeout=60)
    membership = SimpleNamespace(status=SimpleNamespace(to_dict=dict))
    status = StatusServer(relay, membership)  # type: ignore[arg-type]
    await status.start("127.0.0.1", 0)

    def get(query: str) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"{status.url}/v1/membership/status{query}") as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    listed = LoopTurns().wrap(Member, "status")  # a member's status, listed on the loop
    try:
        code, first = await asyncio.to_thread(get, "")
        assert code == 200 and first["members_total"] == MEMBERS
        assert len(first["members"]) == 1000
        seen = [(m["namespace"], m["instance_id"]) for m in first["members"]]
        cursor = first["members_next"]
        while cursor is not None:  # (every member once, in order)
            code, page = await asyncio.to_thread(get, f"?limit=1000&after={cursor}")
            assert code == 200
            seen += [(m["namespace"], m["instance_id"]) for m in page["members"]]
            cursor = page["members_next"]
        assert len(seen) == len(set(seen)) == MEMBERS and seen == sorted(seen)
        for query, param in [("?limit=0", "limit"), ("?limit=1001", "limit"),
                             ("?limit=x", "limit"), ("?limit=%C2%B2", "limit"),
                             ("?limit=" + "9" * 5000, "limit"), ("?after=ns1", "after"),
                             ("?after=ns1/zz", "after")]:  # fmt: skip
            code, body = await asyncio.to_thread(get, query)
            assert code == 400 and body["error"]["param"] == param, (query, body)
    finally:
        await listed.stop()
        await status.stop()
        await relay.stop()
    assert listed.on_loop == MEMBERS  # each once, a page at a time
    most = listed.most_per_turn
    assert most <= STATUS_MEMBERS, f"{most} members listed in one turn of the loop"


def test_every_cursor_the_status_gives_is_one_it_takes() -> None:
    """An instance id of more than 16 hex digits (keys allow any) was given as the cursor
    after it and then refused (400): a walk could not get past that member."""
    for key in [("ns", 1), ("ns/b", 0xFF), ("ns-b", 1 << 64), ("é", (1 << 200) + 7)]:
        assert parse_member_cursor(member_cursor(key)) == key
    for bad in ["ns", "ns/", "/1", "ns/zz", "ns/" + "f" * 65, "ns/-1", "ns/\uff11"]:
        with pytest.raises(ValueError, match="after"):
            parse_member_cursor(bad)
