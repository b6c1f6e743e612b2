"""A simulated KV cache with prefix caching, as vLLM keeps one: blocks named by chained hashes.

A prompt is cut into blocks of `block_size` token ids; each full block is named by the hash
of its tokens and of the block before it, so equal names mean equal prefixes. The cache
keeps the most recently used `capacity` blocks; a prompt whose leading blocks are cached
needs only the rest computed. Every block stored and evicted is reported to `on_event`
(vLLM's `BlockStored` and `BlockRemoved`), which is how the mocker publishes KV events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from shoal.kv import AllBlocksCleared, BlockRemoved, BlockStored, chain_hash

KvEventSink = Callable[[BlockStored | BlockRemoved | AllBlocksCleared], None]


class PrefixCache:
    """An LRU of block hashes, plus the blocks running sequences hold."""

    def __init__(self, capacity: int, block_size: int, on_event: KvEventSink | None = None) -> None:
        if capacity <= 0 or block_size <= 0:
            raise ValueError("capacity and block_size must be positive")
        self.capacity = capacity
        self.block_size = block_size
        self.on_event = on_event
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.blocks_in_use = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def block_hashes(self, tokens: Sequence[int]) -> list[int]:
        """Chained hashes of every full block of `tokens`."""
        hashes: list[int] = []
        parent = 0
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            parent = chain_hash(parent, tokens[start : start + size])
            hashes.append(parent)
        return hashes

    def cached_tokens(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """The prompt tokens the leading cached blocks cover (a lookup; nothing changes)."""
        hits = 0
        for h in hashes:
            if h not in self._blocks:
                break
            hits += 1
        return min(hits * self.block_size, prompt_tokens)

    def admit(self, hashes: Sequence[int], tokens: Sequence[int]) -> int:
        """Count the leading cached blocks, then cache them all; returns the cached tokens.

        Blocks new to the cache are reported stored (one event per run of new blocks,
        naming the block before it as parent), and those pushed out are reported removed.
        """
        cached = self.cached_tokens(hashes, len(tokens))
        blocks = self._blocks
        run_start = -1
        for i, h in enumerate(hashes):
            if h in blocks:
                blocks.move_to_end(h)
                self._stored(hashes, tokens, run_start, i)
                run_start = -1
            else:
                blocks[h] = None
                if run_start < 0:
                    run_start = i
        self._stored(hashes, tokens, run_start, len(hashes))
        evicted: list[int] = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        if evicted:
            self.evicted_blocks += len(evicted)
            if self.on_event is not None:
                self.on_event(BlockRemoved(block_hashes=list(evicted)))
        self.queried_tokens += len(tokens)
        self.hit_tokens += cached
        return cached

    def _stored(self, hashes: Sequence[int], tokens: Sequence[int], start: int, end: int) -> None:
        if start < 0 or self.on_event is None:
            return
        size = self.block_size
        self.on_event(
            BlockStored(
                block_hashes=list(hashes[start:end]),
                parent_block_hash=hashes[start - 1] if start else None,
                token_ids=list(tokens[start * size : end * size]),
                block_size=size,
            )
        )

    def clear(self) -> None:
        """Drop every cached block (reported as `AllBlocksCleared`)."""
        self._blocks.clear()
        if self.on_event is not None:
            self.on_event(AllBlocksCleared())

    @property
    def usage(self) -> float:
        """The fraction of KV blocks held by running sequences."""
        return min(1.0, self.blocks_in_use / self.capacity)
