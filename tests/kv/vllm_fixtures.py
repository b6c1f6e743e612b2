"""KV event payloads exactly as vLLM puts them on the wire, built from its published schema
with plain msgpack arrays (not shoal's structs), so decoding is checked against the format.

vLLM's `KVEventBatch` is `[ts, events, data_parallel_rank]`; each event is a tagged array:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
`["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`. Older vLLMs omit the
trailing `medium` and `data_parallel_rank`; block hashes are ints (older) or bytes (newer).
"""

from __future__ import annotations

from typing import Any

import msgspec


def stored(
    hashes: list[Any], parent: Any, tokens: list[int], block_size: int, *, medium: bool = True
) -> list[Any]:
    event = ["BlockStored", hashes, parent, tokens, block_size, None]
    return [*event, "GPU"] if medium else event


def removed(hashes: list[Any], *, medium: bool = True) -> list[Any]:
    return ["BlockRemoved", hashes, "GPU"] if medium else ["BlockRemoved", hashes]


def cleared() -> list[Any]:
    return ["AllBlocksCleared"]


def batch(*events: list[Any], ts: float = 1_700_000_000.5, dp_rank: int | None = 0) -> bytes:
    body: list[Any] = [ts, list(events)]
    if dp_rank is not None:
        body.append(dp_rank)
    return msgspec.msgpack.encode(body)
