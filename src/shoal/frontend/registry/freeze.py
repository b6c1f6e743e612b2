"""What a frontend's first load leaves to Python's garbage collector: it is frozen out of it.

A fleet's registry is all live, several objects per instance: full collections over it
found nothing and, at 100,000 instances, held the event loop 500-700 ms each while it
loaded. `freeze_while_loading` (`FrontendConfig.freeze_loading`, which `shoal frontend`
sets; process-wide, so an embedded frontend leaves it alone by default) moves what the load
built into the collector's permanent generation as it goes. Only a reference cycle among
frozen objects that dies later is then kept for good; an instance that leaves leaves none
(tests/frontend/test_collector.py).

After the first load, `freeze_bursts` does the same for a burst of registry changes (a
worker announcing its 20,000 adapters at once: unfrozen, each full collection went through
all that the burst built, 30-128 ms of the loop each, growing with it, and found nothing;
a catalog publishing thousands of routes did the same through the route table).
Between bursts the collector runs as usual.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable

from shoal import full_collections

FREEZE_INTERVAL = 0.25  # seconds between two `gc.freeze()` while loading
FREEZE_WINDOW = 120.0  # seconds after loaded that freezing goes on while fetches are in flight
BURST_CHANGES = 256  # registry changes within one `FREEZE_INTERVAL` that make a burst


async def freeze_while_loading(loaded: asyncio.Event, fetched: asyncio.Event) -> None:
    """`gc.freeze()` every `FREEZE_INTERVAL` until `loaded` and `fetched` (the first load's
    metadata fetches ended; at most `FREEZE_WINDOW` after `loaded`). Meanwhile no full
    collection runs (the oldest generation's threshold is lifted, and put back after):
    what it would go through is what the next freeze takes, and each one went through a
    quarter second of the load, 10-17 ms of the loop."""
    loaded_at: float | None = None
    full_collections.defer()
    try:
        while True:
            gc.freeze()
            if loaded.is_set():
                loaded_at = loaded_at or time.monotonic()
                if fetched.is_set() or time.monotonic() - loaded_at > FREEZE_WINDOW:
                    return
            await asyncio.sleep(FREEZE_INTERVAL)
    finally:
        full_collections.resume()


async def freeze_bursts(changes: Callable[[], int]) -> None:
    """For ever: while `changes()` (a count that every registry change bumps) grows by
    `BURST_CHANGES` or more in a `FREEZE_INTERVAL`, freeze as the first load does, with no
    full collection meanwhile; when an interval has fewer, freeze once more and put the
    thresholds back. What is frozen is what the burst built; garbage made in the last
    interval that no younger collection found is kept for good, as with the first load
    (the request path leaves no cycles: tests/frontend/test_request_garbage*.py)."""
    last = changes()
    while True:
        await asyncio.sleep(FREEZE_INTERVAL)
        now = changes()
        if now - last >= BURST_CHANGES:
            full_collections.defer()
            try:
                while now - last >= BURST_CHANGES:
                    gc.freeze()
                    last = now
                    await asyncio.sleep(FREEZE_INTERVAL)
                    now = changes()
                gc.freeze()
            finally:
                full_collections.resume()
        last = now
