"""The batches `KvStreamReader` (`shoal.frontend.kv.stream`) keeps of each instance until they
are applied (`Instance`: its place in the stream, its batches kept), and their `Ledger`: every
instance's kept batches in the order they came, and their bytes, so the oldest go first.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.kv import KVEventBatch

KEPT_COST = 224  # bytes a kept batch holds beyond its payload (measured: ~200)
DECODED_COST = 16  # and per byte of its payload, kept decoded (measured: 5-9, 80 for tiny ones)
StreamKey = tuple[str, int]  # (namespace, instance id)


@dataclass(eq=False, slots=True)
class Kept:
    """A batch kept until it is applied: its payload (`batch` when it is kept decoded), and
    what it is counted for."""

    payload: bytes
    batch: KVEventBatch | None
    size: int
    live: bool = True


class Ledger:
    """Every instance's kept batches in the order they came, and their bytes: past
    the reader's `PENDING_BYTES` the oldest go first (`KvStreamReader._trim`). A batch leaves `order` as
    soon as it is no longer kept, in O(1): entries that stayed until a compaction held their
    batches (1,024 applied batches of a long prefill: ~1.5 GB), and the compaction made the
    order again in one step (~285,000 tiny batches kept: ~37 ms of the loop)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.live = 0
        self.order: OrderedDict[Kept, Instance] = OrderedDict()

    def gone(self, kept: Kept) -> None:
        if kept.live:
            kept.live = False
            self.bytes -= kept.size
            self.live -= 1
            del self.order[kept]
            kept.payload, kept.batch = b"", None


NO_BATCHES: deque[Kept] = deque(maxlen=0)  # every instance's with none kept (760 bytes)


@dataclass(eq=False, slots=True)
class Instance:
    """One instance's place in the stream, and where its batches go."""

    ledger: Ledger
    key: StreamKey
    last_seq: int = -1  # the worker's number of the last batch applied (-1: none known)
    last_ts: float = 0.0  # and its timestamp
    pending: deque[Kept] = field(default_factory=lambda: NO_BATCHES)
    apply: Callable[[KVEventBatch], None] | None = None
    purge: Callable[[], None] | None = None
    flushing: asyncio.Task[None] | None = None
    losses: int = 0  # a batch being applied in slices stops when this moves
    left: bool = False  # a `left` came while it was followed: forgotten when unfollowed

    def keep(self, payload: bytes, batch: KVEventBatch | None = None) -> None:
        size = KEPT_COST + len(payload) * (1 if batch is None else DECODED_COST)
        kept = Kept(payload, batch, size)
        if self.pending is NO_BATCHES:
            self.pending = deque()
        self.pending.append(kept)
        ledger = self.ledger
        ledger.bytes += size
        ledger.live += 1
        ledger.order[kept] = self

    def take(self) -> tuple[bytes, KVEventBatch | None]:
        """The oldest batch kept, no longer kept: its payload, and its events when it was
        kept decoded."""
        kept = self.pending.popleft()
        taken = kept.payload, kept.batch
        self.ledger.gone(kept)
        if not self.pending:
            self.pending = NO_BATCHES  # (an emptied deque keeps 16 blocks of 64 for reuse: 8 KB)
        return taken

    def clear(self) -> None:
        for kept in self.pending:
            self.ledger.gone(kept)
        self.pending = NO_BATCHES

    def lose(self, after: bool = False) -> None:
        """What is held of this instance may be wrong: drop it, and the batches kept
        unless they came `after` what was lost (an unreadable batch its flush task took)."""
        self.losses += 1
        if not after:
            self.clear()
        if self.purge is not None:
            self.purge()
