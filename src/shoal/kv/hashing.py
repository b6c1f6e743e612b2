"""Chained token-block hashing: block i's hash covers blocks 0..i, so equal hashes mean
equal prefixes, and a map from hash to holder is a radix tree over prompts, flattened.

The frontend hashes both the token ids of stored-block events and the tokens of each
prompt with this one function, so the engines' own hash functions never matter. The hash
is CPython's tuple hash of ints: computed in C, and the same in every process.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT_HASH = 0
"""The parent of a prompt's first block."""


def chain_hash(parent: int, block: Sequence[int]) -> int:
    """The hash of `block` following the block hashed `parent`."""
    return hash((parent, *block))


def token_block_hashes(
    tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH, limit: int | None = None
) -> list[int]:
    """Chained hashes of every full block of `tokens` (at most `limit` blocks)."""
    count = len(tokens) // block_size
    if limit is not None:
        count = min(count, limit)
    hashes: list[int] = []
    h = parent
    for i in range(count):
        h = hash((h, *tokens[i * block_size : (i + 1) * block_size]))
        hashes.append(h)
    return hashes
