"""Large JSON arrays decoded and encoded on the event loop a slice of bytes at a time.

msgspec decodes and encodes in one C call that holds the GIL, so moving one to a thread
(`asyncio.to_thread`) does not spare the event loop: an 8 MiB `/models` listing decoded in a
thread held it ~60-90 ms all the same. Instead, a large answer is read once with its items
left encoded (a struct whose array is `list[msgspec.Raw]`: views of the answer, one pass that
only skips them, ~1 ms a MiB), and its items are then decoded here a slice of at most
`SLICE_BYTES` at a time, yielding to the loop before each slice. The KV events' msgpack
batches are read the same way (`shoal.kv.sliced.decode_batch_in_slices`). A large array is
encoded likewise, `ENCODED_PER_SLICE` items a step (`encode_in_slices`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import msgspec

from shoal.bounds import MAX_DEPTH, check_json_depth

T = TypeVar("T")

SLICE_BYTES = 64 << 10
"""Bytes of items decoded in one step on the event loop at most (64 KiB of a listing: ~600
entries of vLLM's, well under a millisecond of msgspec)."""
ENCODED_PER_SLICE = 1000
"""Items encoded in one step on the event loop at most (1,000 rows of a usage report: ~140 KB,
~0.2 ms; 100,000 in one call held the loop ~20 ms)."""


class ItemTooLarge(ValueError):
    """One item of an array is over the bytes an item may have (said before it is decoded)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"an item of {size:,} bytes, over the {limit:,} an item may have")
        self.size, self.limit = size, limit


def decode_slice(
    items: Sequence[msgspec.Raw],
    decoder: msgspec.json.Decoder[list[T]],
    depth: int | None,
    utf8: bool = False,
) -> list[T]:
    """`items` decoded in one call (copied into one array), its depth (the array counts one
    level) checked first unless `depth` is None (`TooDeep`), and its UTF-8 if `utf8` (what a
    decoder skips, a Struct's unknown fields, it does not check: `msgspec.DecodeError`)."""
    if not items:
        return []
    joined = b"[" + b",".join(items) + b"]"
    if depth is not None:
        check_json_depth(joined, depth)
    if utf8 and not joined.isascii():
        try:
            joined.decode()
        except UnicodeDecodeError:
            raise msgspec.DecodeError("Invalid UTF-8 encoded string") from None
    return decoder.decode(joined)


async def decoded_slices(
    items: Sequence[msgspec.Raw],
    decoder: msgspec.json.Decoder[list[T]],
    *,
    slice_bytes: int = SLICE_BYTES,
    item_bytes: int | None = SLICE_BYTES,
    depth: int | None = MAX_DEPTH,
    utf8: bool = False,
) -> AsyncIterator[list[T]]:
    """`items` decoded by `decoder`, in order, a slice of at most `slice_bytes` at a time,
    after a yield to the event loop before each (the caller's work on a slice, done before it
    asks for the next, shares its step). An item over `item_bytes` is `ItemTooLarge` (None:
    one over `slice_bytes` is a slice of its own); a slice nesting deeper than `depth` is
    `TooDeep` (None: unchecked, and a value past the interpreter's recursion limit is the
    decoder's `RecursionError`); what the decoder refuses is its `msgspec.DecodeError`, and
    with `utf8` so is a slice that is not UTF-8 (checked for what the decoder skips)."""
    piece: list[msgspec.Raw] = []
    held = 0
    for item in items:
        size = len(item)
        if item_bytes is not None and size > item_bytes:
            raise ItemTooLarge(size, item_bytes)
        if piece and held + size > slice_bytes:
            await asyncio.sleep(0)
            yield decode_slice(piece, decoder, depth, utf8)
            piece, held = [], 0
        piece.append(item)
        held += size
    if piece:
        await asyncio.sleep(0)
        yield decode_slice(piece, decoder, depth, utf8)


async def encode_in_slices(items: Sequence[Any], per_slice: int = ENCODED_PER_SLICE) -> bytes:
    """`items` as one JSON array, the same bytes as `msgspec.json.encode(list(items))`, encoded
    `per_slice` items a step on the event loop, yielding between steps. The slices are put
    together in one join (`b"[" + b",".join(...) + b"]"` copied 10 MB three times: ~15 ms)."""
    parts: list[bytes] = [b"["]
    for start in range(0, len(items), per_slice):
        if start:
            await asyncio.sleep(0)
            parts.append(b",")
        parts.append(msgspec.json.encode(items[start : start + per_slice])[1:-1])
    parts.append(b"]")
    return b"".join(parts)
