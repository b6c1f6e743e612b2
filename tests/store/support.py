"""Test support for the store tests: a watch's events, applied to a dict as a consumer does."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from shoal.store import Delete, Event, KeyRevision, KeyValue, Listing, Put, Snapshot
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


def held_after(
    held: dict[str, KeyValue], listing: Listing, since: int
) -> dict[str, tuple[int, int, int, bytes]]:
    """What a reader that held `held` (read at `since`) holds once it applies `listing`:
    each key's revisions, lease and value. Checks what the contract allows of each item."""
    if listing.removed is None:  # every key listed; an older value may be left out
        now: dict[str, KeyValue] = {}
        for kv in listing.items:
            if isinstance(kv, KeyRevision):
                assert kv.mod_revision <= since, kv
                assert held[kv.key].mod_revision == kv.mod_revision, kv
                now[kv.key] = held[kv.key]
            else:
                now[kv.key] = kv
    else:  # a delta: only what was written since, and what is gone since
        now = dict(held)
        for kv in listing.items:
            assert isinstance(kv, KeyValue) and kv.mod_revision > since, kv
            now[kv.key] = kv
        for key in listing.removed:
            now.pop(key, None)
    return {k: (kv.mod_revision, kv.create_revision, kv.lease, kv.value) for k, kv in now.items()}


def as_held(snap: Snapshot) -> dict[str, tuple[int, int, int, bytes]]:
    return {kv.key: (kv.mod_revision, kv.create_revision, kv.lease, kv.value) for kv in snap.items}
