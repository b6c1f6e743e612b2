"""Python's full garbage collections kept out of the models controller's passes.

A pass holds its listings while it runs (at 10,000 models, over 100,000 objects the collector
tracks); its allocations set off full collections over them, which found next to nothing and
held the event loop, the catalog API's beside it, 50-300 ms each. `PassCollections` defers
full collections while a pass runs (the oldest generation's threshold is lifted), and once a
pass has ended, its listings freed by their reference counts, runs one over what is left.
After the first pass, what the process has built by then (modules, the API, pools) is frozen
out of the collector (`gc.freeze()`), so that collection scans only what is new since.
Process-wide settings: `shoal catalog serve` turns this on (`ControllerConfig`), a controller
embedded in another program's process leaves the collector alone.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from shoal import full_collections


class PassCollections:
    """Full collections deferred during a pass, one run after it (see the module)."""

    def __init__(self) -> None:
        self.frozen = False  # the process's objects after the first pass: out of collections
        self.collections = 0  # full collections run after a pass

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """No full collection starts inside (the thresholds are put back after, by the last
        deferral to end: `shoal.full_collections` counts them, process-wide)."""
        with full_collections.deferred():
            yield

    def after_pass(self) -> None:
        """One full collection, the pass's listings gone; after the first, a freeze of what
        is left (the process's own objects: only a cycle among them that dies later is kept)."""
        gc.collect()
        self.collections += 1
        if not self.frozen:
            gc.freeze()
            self.frozen = True
