"""The batches `KvStreamReader` (`shoal.frontend.kv.stream`) keeps of each instance until they
are applied (`Instance`: its place in the stream, its batches kept), and their `Ledger`: every
instance's kept batches in the order they came, and their bytes, so the oldest go first.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.kv import KVEventBatch

KEPT_COST = 248  # bytes a kept batch holds beyond its payload (measured: ~245)
DECODED_COST = 16  # and per byte of its payload, kept decoded (measured: 5-9, 80 for tiny ones)
StreamKey = tuple[str, int]  # (namespace, instance id)
Entry = tuple[bytes, KVEventBatch | None, StreamKey]
"""A batch kept until it is applied: its payload (and its events when kept decoded) and its
instance's key. A tuple of such values is one the garbage
collector stops tracking at its first collection: kept batches were objects of a class, and
~285,000 of them (64 MiB of tiny batches, a reader catching up) made every full collection
go through them, 190-530 ms of the event loop each."""


class Ledger:
    """Every instance's kept batches in the order they came, by a number of their own, and
    their bytes: past the reader's `PENDING_BYTES` the oldest go first
    (`KvStreamReader._trim`). A batch leaves `order` as soon as it is no longer kept, in
    O(1): entries that stayed until a compaction held their batches (1,024 applied batches of
    a long prefill: ~1.5 GB), and the compaction made the order again in one step (~285,000
    tiny batches kept: ~37 ms of the loop)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.live = 0
        self.order: OrderedDict[int, Entry] = OrderedDict()
        self._numbers = itertools.count()

    def add(self, payload: bytes, batch: KVEventBatch | None, key: StreamKey) -> int:
        number = next(self._numbers)
        self.order[number] = (payload, batch, key)
        self.bytes += cost(payload, batch)
        self.live += 1
        return number

    def gone(self, number: int) -> Entry | None:
        """The batch `number`, no longer kept (None: it was not)."""
        entry = self.order.pop(number, None)
        if entry is not None:
            self.bytes -= cost(entry[0], entry[1])
            self.live -= 1
        return entry


def cost(payload: bytes, batch: KVEventBatch | None) -> int:
    """The bytes a kept batch is counted for (made again when it goes: not kept beside it)."""
    return KEPT_COST + len(payload) * (1 if batch is None else DECODED_COST)


NO_BATCHES: deque[int] = deque(maxlen=0)  # every instance's with none kept (760 bytes)


@dataclass(eq=False, slots=True)
class Instance:
    """One instance's place in the stream, and where its batches go."""

    ledger: Ledger
    key: StreamKey
    last_seq: int = -1  # the worker's number of the last batch applied (-1: none known)
    last_ts: float = 0.0  # and its timestamp
    pending: deque[int] = field(default_factory=lambda: NO_BATCHES)  # its batches' numbers
    apply: Callable[[KVEventBatch], None] | None = None
    purge: Callable[[], None] | None = None
    flushing: asyncio.Task[None] | None = None
    losses: int = 0  # a batch being applied in slices stops when this moves
    left: bool = False  # a `left` came while it was followed: forgotten when unfollowed

    def keep(self, payload: bytes, batch: KVEventBatch | None = None) -> None:
        if self.pending is NO_BATCHES:
            self.pending = deque()
        self.pending.append(self.ledger.add(payload, batch, self.key))

    def take(self) -> tuple[bytes, KVEventBatch | None]:
        """The oldest batch kept, no longer kept: its payload, and its events when it was
        kept decoded."""
        entry = self.ledger.gone(self.pending.popleft())
        if not self.pending:
            self.pending = NO_BATCHES  # (an emptied deque keeps 16 blocks of 64 for reuse: 8 KB)
        assert entry is not None  # (an instance's numbers leave the ledger only through it)
        return entry[0], entry[1]

    def clear(self) -> None:
        gone = self.ledger.gone
        for number in self.pending:
            gone(number)
        self.pending = NO_BATCHES

    def lose(self, after: bool = False) -> None:
        """What is held of this instance may be wrong: drop it, and the batches kept
        unless they came `after` what was lost (an unreadable batch its flush task took)."""
        self.losses += 1
        if not after:
            self.clear()
        if self.purge is not None:
            self.purge()
