"""`/v1/membership` of a large view: its JSON is made off the event loop, once per view."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from shoal.discovery import EndpointId
from shoal.membership import EndpointView, Membership
from tests.kv.probes import LoopProbe


def large_view(count: int) -> Membership:
    endpoints: dict[Any, EndpointView] = {}
    for i in range(count):
        card = SimpleNamespace(display_name=f"model-{i % 100}", role="aggregated", taints=())
        model: Any = SimpleNamespace(card=card, key=SimpleNamespace(suffix=f"s{i}"), mdcsum="f")
        endpoint = EndpointId(f"ns{i % 100}", "backend", "generate")
        endpoints[(endpoint, i + 1)] = EndpointView(endpoint, i + 1, (model,), i)
    return Membership("r1", {}, endpoints)


async def test_the_json_of_ten_thousand_endpoints_is_made_off_the_loop_once_per_view() -> None:
    """`to_dict()` and its encoding on the loop held it ~60 ms at 10,000 endpoints."""
    view = large_view(10_000)
    probe = LoopProbe()
    data = await view.json()
    held = await probe.stop()
    assert json.loads(data) == view.to_dict()
    assert await view.json() is data  # (the same view: encoded once)
    other = large_view(3)
    assert json.loads(await other.json()) == other.to_dict()  # (a new view: encoded again)
    assert held < 0.02, f"the event loop was held {held * 1000:.0f} ms"
