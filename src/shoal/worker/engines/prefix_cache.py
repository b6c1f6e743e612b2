"""A simulated KV cache with prefix caching, as vLLM keeps one: blocks named by chained hashes.

A prompt is cut into blocks of `block_size` tokens; each full block is named by the hash of
its tokens and of the block before it, so equal names mean equal prefixes. The cache keeps
the most recently used `capacity` block names; a prompt whose leading blocks are cached
needs only the rest computed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """An LRU of block hashes, plus the blocks running sequences hold."""

    def __init__(self, capacity: int, block_size: int) -> None:
        if capacity <= 0 or block_size <= 0:
            raise ValueError("capacity and block_size must be positive")
        self.capacity = capacity
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.blocks_in_use = 0
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def block_hashes(self, tokens: Sequence[str]) -> list[bytes]:
        """Chained hashes of every full block of `tokens`."""
        hashes: list[bytes] = []
        parent = b""
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = "\x1f".join(tokens[start : start + size]).encode()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            hashes.append(parent)
        return hashes

    def admit(self, hashes: Sequence[bytes], prompt_tokens: int) -> int:
        """Count the leading cached blocks, then cache them all; returns the cached tokens."""
        hits = 0
        for h in hashes:
            if h not in self._blocks:
                break
            hits += 1
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        cached = min(hits * self.block_size, prompt_tokens)
        self.queried_tokens += prompt_tokens
        self.hit_tokens += cached
        return cached

    @property
    def usage(self) -> float:
        """The fraction of KV blocks held by running sequences."""
        return min(1.0, self.blocks_in_use / self.capacity)
