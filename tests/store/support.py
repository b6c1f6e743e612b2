"""Test support for the store tests: a watch's events, applied to a dict as a consumer does."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from shoal.store import Delete, Event, Put
from tests.helpers import Collector


class Recorder(Collector[Event]):
    """Keeps a watch's events, applies them to `state` (which starts as `initial`), and notes
    when each key's first Put arrived."""

    def __init__(self, stream: AsyncIterator[Event], initial: dict[str, bytes] | None = None):
        self.state = dict(initial or {})
        self.arrived: dict[str, float] = {}
        super().__init__(stream)

    def _apply(self, event: Event) -> None:
        if isinstance(event, Put):
            self.state[event.key] = event.value
            self.arrived.setdefault(event.key, time.monotonic())
        elif isinstance(event, Delete):
            self.state.pop(event.key, None)
        else:
            self.state = {kv.key: kv.value for kv in event.items}

    def ordered_state(self) -> dict[str, bytes]:
        """`state`, once the events are checked to have come in revision order."""
        last = 0
        for e in self.events:
            assert e.revision >= last, f"events out of revision order: {self.events}"
            last = e.revision
        return self.state
