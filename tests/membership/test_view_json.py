"""`/v1/membership` of a large view: its JSON is made off the event loop, once per view."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from shoal.discovery import EndpointId
from shoal.membership import EndpointView, Membership
from tests.helpers import LoopTurns


def large_view(count: int) -> Membership:
    endpoints: dict[Any, EndpointView] = {}
    for i in range(count):
        card = SimpleNamespace(display_name=f"model-{i % 100}", role="aggregated", taints=())
        model: Any = SimpleNamespace(card=card, key=SimpleNamespace(suffix=f"s{i}"), mdcsum="f")
        endpoint = EndpointId(f"ns{i % 100}", "backend", "generate")
        endpoints[(endpoint, i + 1)] = EndpointView(endpoint, i + 1, (model,), i)
    return Membership("r1", {}, endpoints)


async def test_the_json_of_ten_thousand_endpoints_is_made_once_per_view_never_all_at_once() -> None:
    """`to_dict()` and its encoding on the loop held it ~60 ms at 10,000 endpoints. Each
    endpoint's dict is made in a thread (Python code: the loop takes the GIL back every
    switch interval), and they are encoded on the loop `ENCODED_PER_SLICE` at most a turn:
    msgspec encodes in one C call holding the GIL, so the whole view encoded in a thread
    held the loop all the same (~6 ms at 10,000 endpoints, ~33 ms at 50,000). Counted where
    it runs, not timed."""
    import msgspec

    from shoal import slices

    view = large_view(10_000)
    made = LoopTurns().wrap(EndpointView, "to_dict")
    encoded = LoopTurns().wrap(msgspec.json, "encode", endpoints_in)
    try:
        data = await view.json()
        assert await view.json() is data  # (the same view: encoded once)
    finally:
        await made.stop()
        await encoded.stop()
    assert made.on_loop == 0 and made.off_loop == 10_000
    assert encoded.off_loop == 0 and encoded.on_loop == 10_000
    most = encoded.most_per_turn
    assert most <= slices.ENCODED_PER_SLICE, f"{most} endpoints encoded in one turn"
    assert data == msgspec.json.encode(view.to_dict())  # (the very bytes it was)
    assert json.loads(data) == view.to_dict()
    other = large_view(3)
    assert json.loads(await other.json()) == other.to_dict()  # (a new view: encoded again)
    status = Membership("r2", {"ns": ()}, {}, 4, "c7")
    assert await status.json() == msgspec.json.encode(status.to_dict())  # (no endpoints)


def endpoints_in(value: Any, *_: Any, **__: Any) -> int:
    """The endpoints a call of `msgspec.json.encode` encodes (the view's, or a slice of them)."""
    if isinstance(value, dict) and isinstance(value.get("endpoints"), list):
        value = value["endpoints"]
    return (
        sum(isinstance(v, dict) and "instance_id" in v for v in value)
        if isinstance(value, list)
        else 0
    )


async def test_requests_that_come_together_for_a_new_view_share_one_encoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The view was kept only once encoded: 30 requests just after a change each built and
    encoded it (3 s of threads holding the GIL at 10,000 endpoints, `/live` waiting ~2 s)."""
    view = large_view(50)
    made: list[int] = []
    to_dict = Membership.to_dict
    monkeypatch.setattr(Membership, "to_dict", lambda self: made.append(1) or to_dict(self))
    answers = await asyncio.gather(*(view.json() for _ in range(30)))
    assert made == [1]
    assert len(set(answers)) == 1 and json.loads(answers[0])["endpoints"]
