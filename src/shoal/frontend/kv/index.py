"""`KvIndex`: which instances of one worker set hold which KV blocks, from their KV events.

Blocks are named by the frontend's own chained hash of their token ids (`shoal.kv`), so a
prompt hashed the same way is looked up directly: `holders` maps a block hash to the
instances holding it, and since a block's hash covers its whole prefix, the map is a radix
tree over prompts, flattened. Engines name blocks with hashes of their own, which events
use for parents and removals: each instance's `engine hash -> our hash` map translates.

Invariant, both ways: an instance is in `holders[h]` exactly when its last applied events
stored block `h` and neither removed it, cleared its cache, nor was it purged; but the
blocks of a large purge leave `holders` a slice per turn of the event loop (`PURGE_SLICE`),
and meanwhile `overlaps` counts that instance nowhere. A stored
block whose parent the index does not know (an event was lost and not replayed) is not
indexed: a guess would route prompts to a cache that may not hold their prefix.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable

from shoal.kv import ROOT_HASH, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, chain_hash
from shoal.kv.events import BlockHash

MAX_INSTANCE_BLOCKS = 1 << 18
"""Blocks indexed per instance at most (4M tokens at 16 a block, more than any engine's
cache): an instance past it is purged and counted in `over_cap`, as for a lost event."""

PURGE_SLICE = 4096
"""Blocks of a purged instance released per turn of the event loop (~2 ms): an instance at
the cap released in one go held the loop ~120 ms. A purge of more goes on in the next turns
(at once where no loop runs)."""


class KvIndex:
    """Block hash → instances holding it, for one worker set (one model, one block size)."""

    def __init__(self, block_size: int, max_instance_blocks: int = MAX_INSTANCE_BLOCKS) -> None:
        self.block_size = block_size
        self.max_instance_blocks = max_instance_blocks
        self.over_cap: dict[int, int] = {}  # instance -> times it was purged for it
        self.holders: dict[int, set[int]] = {}
        # `overlaps`' steps: block -> (the stamp of the step before, the block's version,
        # the instances still in that do not hold it, its own stamp); a block in one has a
        # version, new with every change of its holders
        self._steps: dict[int, tuple[int, int, tuple[int, ...], int]] = {}
        self._version: dict[int, int] = {}
        self._versions = itertools.count(1)
        self.compared = 0  # instances looked up by `overlaps`' subset tests (a cost figure)
        self.recent = RecentPicks()  # predictions: an eviction or purge cancels them
        self._blocks: dict[int, dict[BlockHash, int]] = {}  # instance -> engine hash -> ours
        self.orphan_blocks = 0  # stored blocks dropped because their parent was unknown
        self.mismatched_events = 0  # events whose block size is not the set's
        # instance -> its purged blocks still held (taken out one by one: freed a slice at a
        # time too, a quarter million ints freed at once held the loop ~15 ms)
        self._dying: dict[int, list[dict[BlockHash, int]]] = {}
        self._restored: dict[int, set[int]] = {}  # instance -> stored again while dying
        self._releasing: asyncio.Handle | None = None
        self._released_now = 0  # blocks purged at once in this turn of the loop

    def __len__(self) -> int:
        """Blocks indexed, counting each (block, instance) once."""
        return sum(len(blocks) for blocks in self._blocks.values())

    def instance_blocks(self, instance_id: int) -> int:
        return len(self._blocks.get(instance_id, ()))

    def apply(self, instance_id: int, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            self.stored(instance_id, event)
        elif isinstance(event, BlockRemoved):
            self.removed(instance_id, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.purge(instance_id)

    def stored(self, instance_id: int, event: BlockStored) -> None:
        size = self.block_size
        if event.block_size != size or len(event.token_ids) < size * len(event.block_hashes):
            self.mismatched_events += 1
            return
        if event.lora_id is not None:
            return  # an adapter's blocks: not this (base model) set's
        blocks = self._blocks.setdefault(instance_id, {})
        if event.parent_block_hash is None:
            parent = ROOT_HASH
        else:
            known = blocks.get(event.parent_block_hash)
            if known is None:
                self.orphan_blocks += len(event.block_hashes)
                return
            parent = known
        tokens = event.token_ids
        holders, version = self.holders, self._version
        for i, engine_hash in enumerate(event.block_hashes):
            parent = chain_hash(parent, tokens[i * size : (i + 1) * size])
            previous = blocks.get(engine_hash)
            if previous is not None and previous != parent:
                self._release(previous, instance_id)
            blocks[engine_hash] = parent
            if instance_id in self._dying:  # (not released with its purged blocks)
                self._restored.setdefault(instance_id, set()).add(parent)
            holding = holders.get(parent)
            if holding is None:
                holders[parent] = {instance_id}
            else:
                holding.add(instance_id)
                if parent in version:
                    version[parent] = next(self._versions)
        if len(blocks) > self.max_instance_blocks:
            self.purge(instance_id)
            self.over_cap[instance_id] = self.over_cap.get(instance_id, 0) + 1

    def removed(self, instance_id: int, engine_hashes: Iterable[BlockHash]) -> None:
        blocks = self._blocks.get(instance_id)
        if not blocks:
            return
        for engine_hash in engine_hashes:
            ours = blocks.pop(engine_hash, None)
            if ours is not None:
                self._release(ours, instance_id)

    def purge(self, instance_id: int) -> None:
        """Forget every block of `instance_id` (it left, cleared its cache, or lost events):
        at once up to `PURGE_SLICE` blocks, else a slice per turn of the event loop."""
        blocks = self._blocks.pop(instance_id, None)
        if not blocks:
            return
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # (no loop: a plain call, all at once)
            loop = None
        dying = self._dying.get(instance_id)
        # At once while this turn's purges stay within a slice (many instances purged
        # together, a stream lost, count as one).
        if loop is None or (
            dying is None and not self._dying and self._released_now + len(blocks) <= PURGE_SLICE
        ):
            if loop is not None:
                if not self._released_now:
                    loop.call_soon(self._new_turn)
                self._released_now += len(blocks)
            for ours in blocks.values():
                self._release(ours, instance_id)
            return
        if dying is None:
            self._dying[instance_id] = [blocks]
        else:  # purged again while dying: what it stored since dies too
            dying.append(blocks)
            self._restored.pop(instance_id, None)
        if self._releasing is None:
            self._releasing = loop.call_soon(self._release_turn, loop)

    def _new_turn(self) -> None:
        self._released_now = 0

    def _release_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        self._releasing = None
        self._release_dying()
        if self._dying:
            self._releasing = loop.call_soon(self._release_turn, loop)

    def _release_dying(self) -> None:
        """Release `PURGE_SLICE` blocks of purged instances."""
        budget = PURGE_SLICE
        for instance_id, dying in list(self._dying.items()):
            restored = self._restored.get(instance_id, ())
            while dying and budget > 0:
                blocks = dying[-1]
                taken = min(budget, len(blocks))
                pop = blocks.popitem
                for _ in range(taken):
                    ours = pop()[1]
                    if ours not in restored:
                        self._release(ours, instance_id)
                budget -= taken
                if not blocks:
                    dying.pop()
            if not dying:
                del self._dying[instance_id]
                self._restored.pop(instance_id, None)
            if budget <= 0:
                break

    def _release(self, ours: int, instance_id: int) -> None:
        restored = self._restored.get(instance_id)
        if restored:
            restored.discard(ours)
        self.recent.forget(ours, instance_id)
        holding = self.holders.get(ours)
        if holding is not None:
            holding.discard(instance_id)
            if not holding:
                del self.holders[ours]
                if self._version.pop(ours, None) is not None:
                    self._steps.pop(ours, None)
            elif ours in self._version:
                self._version[ours] = next(self._versions)

    def overlaps(self, hashes: list[int]) -> dict[int, int]:
        """For each instance holding the prompt's first block: how many leading blocks it holds.

        Walks the prompt's blocks while some instance still holds every block so far: the
        work is bounded by the longest cached prefix, not by the prompt or the index. A
        block's step (which instances still in do not hold it?) costs a subset test of
        them; it is kept (`_steps`, one per block: a block's hash names the blocks before
        it) and taken again while neither its holders nor any step before it changed. So a
        prefix many instances hold costs them once a pick (and those dropping out), not once
        a block, but in the first pick after its holders changed (`compared` counts). An
        instance's depth is written once, when it drops out or at the end.
        """
        matched: dict[int, int] = {}
        holders, steps, version = self.holders, self._steps, self._version
        alive: set[int] = set()
        before = 0  # the stamp of the step before (0: none yet)
        depth = 0
        for h in hashes:
            holding = holders.get(h)
            if not holding:
                break
            step = steps.get(h)
            if step is not None and step[0] == before and step[1] == version.get(h):
                dropped = step[2]
                if not depth:
                    alive = set(holding)
            else:
                if not depth:
                    alive, dropped = set(holding), ()
                else:
                    self.compared += len(alive)
                    dropped = () if alive <= holding else tuple(alive - holding)
                if h not in version:
                    version[h] = next(self._versions)
                step = steps[h] = (before, version[h], dropped, next(self._versions))
            before = step[3]
            if dropped:
                if len(dropped) == len(alive):
                    break  # (none holds it: every one still in stops here)
                for instance_id in dropped:
                    matched[instance_id] = depth
                alive.difference_update(dropped)
            depth += 1
        for instance_id in alive:
            matched[instance_id] = depth
        for instance_id in self._dying:  # (purged: its blocks leave a slice at a time)
            matched.pop(instance_id, None)
        return matched


class RecentPicks:
    """Prompt blocks just sent to an instance, counted as cached there for `ttl` seconds.

    The instance's events confirm (or deny, by evicting) within milliseconds; until then a
    burst of prompts sharing a prefix would otherwise all see an empty index and be spread
    over every instance. Each block remembers only its latest pick. Bounded in two
    generations of `capacity / 2` blocks: the new one takes the picks, and once full it is
    the old one (the old one before let go). Never a pass over all: copying the unexpired
    ones, once per 32,768 new blocks, held the loop 15-37 ms on the pick's request.
    """

    def __init__(self, ttl: float = 2.0, capacity: int = 65_536) -> None:
        self.ttl = ttl
        self.capacity = capacity
        self._picks: dict[int, tuple[int, float]] = {}  # the new generation
        self._older: dict[int, tuple[int, float]] = {}  # the one before (what it has not)

    def __len__(self) -> int:
        return len(self._picks) + len(self._older)

    def record(self, hashes: list[int], instance_id: int, now: float) -> None:
        picks = self._picks
        if len(picks) + len(hashes) > self.capacity // 2 and picks:
            self._older, self._picks = picks, {}  # (the generation before let go)
            picks = self._picks
        picks.update(zip(hashes, itertools.repeat((instance_id, now + self.ttl))))

    def forget(self, block_hash: int, instance_id: int) -> None:
        """`instance_id` no longer holds the block (it evicted it): not a prediction either."""
        for picks in (self._picks, self._older):
            entry = picks.get(block_hash)
            if entry is not None and entry[0] == instance_id:
                del picks[block_hash]

    def matched(self, hashes: list[int], now: float) -> tuple[int, int]:
        """The instance the prompt's leading blocks were last sent to, and how many: (id, 0)
        when none."""
        picks, older = self._picks, self._older
        owner, depth = 0, 0
        for h in hashes:
            entry = picks.get(h) or older.get(h)
            if entry is None or entry[1] < now or (depth and entry[0] != owner):
                break
            owner, depth = entry[0], depth + 1
        return owner, depth
