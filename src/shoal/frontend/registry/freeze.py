"""What a frontend's first load leaves to Python's garbage collector: it is frozen out of it.

A fleet's registry is all live, several objects per instance: full collections over it
found nothing and, at 100,000 instances, held the event loop 500-700 ms each while it
loaded. `freeze_while_loading` (`FrontendConfig.freeze_loading`, which `shoal frontend`
sets; process-wide, so an embedded frontend leaves it alone by default) moves what the load
built into the collector's permanent generation as it goes. Only a reference cycle among
frozen objects that dies later is then kept for good; an instance that leaves leaves none
(tests/frontend/test_collector.py).
"""

from __future__ import annotations

import asyncio
import gc
import time

FREEZE_INTERVAL = 0.25  # seconds between two `gc.freeze()` while loading
FREEZE_WINDOW = 120.0  # seconds after loaded that freezing goes on while fetches are in flight

_loading = 0  # loads freezing now, in this process
_saved: tuple[int, int, int] | None = None  # the thresholds before the first of them


async def freeze_while_loading(loaded: asyncio.Event, fetched: asyncio.Event) -> None:
    """`gc.freeze()` every `FREEZE_INTERVAL` until `loaded` and `fetched` (the first load's
    metadata fetches ended; at most `FREEZE_WINDOW` after `loaded`). Meanwhile no full
    collection runs (the oldest generation's threshold is lifted, and put back after):
    what it would go through is what the next freeze takes, and each one went through a
    quarter second of the load, 10-17 ms of the loop."""
    global _loading, _saved
    loaded_at: float | None = None
    if _loading == 0:  # (the first of several loads in one process lifts it, the last puts it back)
        _saved = gc.get_threshold()
        gc.set_threshold(_saved[0], _saved[1], 2**30)
    _loading += 1
    try:
        while True:
            gc.freeze()
            if loaded.is_set():
                loaded_at = loaded_at or time.monotonic()
                if fetched.is_set() or time.monotonic() - loaded_at > FREEZE_WINDOW:
                    return
            await asyncio.sleep(FREEZE_INTERVAL)
    finally:
        _loading -= 1
        if _loading == 0 and _saved is not None:
            gc.set_threshold(*_saved)
