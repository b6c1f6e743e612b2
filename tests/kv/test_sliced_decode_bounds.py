"""`decode_batch_in_slices` bounds each step by bytes whatever a 4 MiB payload is made of.

msgspec skips a value at a cost per value it holds, not per byte: one pass over a whole batch
(to find its events) and one over a large event (to find its arrays) held the loop 9-18 ms on
4 MiB of 1-byte ids or of empty arrays in a field no reader knows, against 3.5 for ids of 5
bytes (the hunt of 7 Dec 2026). Counted here: the bytes of msgpack msgspec reads in a turn of
the loop, to find where values end (`framing.values_end`) or to decode them."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from shoal.kv import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    encode_batch_map,
    framing,
)
from shoal.kv import events as kv_events
from shoal.kv import sliced as kv_sliced
from shoal.kv.sliced import DECODE_SLICE_BYTES, MAX_IGNORED_BYTES, decode_batch_in_slices
from shoal.kv.subscription import MAX_BATCH_BYTES
from tests.helpers import LoopTurns

ROOM = MAX_BATCH_BYTES - 4096  # (bytes of ids or hashes in a batch at its bound)


class _CountedDecoder:
    """A msgspec decoder whose every call counts the bytes it was given."""

    def __init__(self, real: Any, turns: LoopTurns) -> None:
        self.real, self.turns = real, turns

    def decode(self, data: Any) -> Any:
        self.turns.note(len(data))
        return self.real.decode(data)


def msgpack_read_per_turn(monkeypatch: pytest.MonkeyPatch) -> LoopTurns:
    """Bytes of msgpack read a turn of the loop: skipped to find where values end (all of the
    window when they do not end in it), events and elements decoded, a batch's fields."""
    turns = LoopTurns()
    real_end = framing.values_end

    def values_end(data: memoryview, at: int, count: int, within: int) -> int | None:
        end = real_end(data, at, count, within)
        turns.note(min(within, len(data) - at) if end is None else end - at)
        return end

    monkeypatch.setattr(framing, "values_end", values_end)
    turns.wrap(kv_sliced, "decode_events", lambda raws, *_: sum(map(len, raws)))
    turns.wrap(kv_sliced, "decode_elements", lambda _, __, body: len(body))
    monkeypatch.setattr(kv_sliced, "_raw_decoder", _CountedDecoder(kv_sliced._raw_decoder, turns))
    return turns


def _one_stored(ids: list[int]) -> BlockStored:
    return BlockStored([], None, ids, 16)


HOSTILE = {
    "one event of 1-byte ids": lambda: encode_batch(KVEventBatch(1.0, [_one_stored([1] * ROOM)])),
    "one event of 1-byte ids, a map": lambda: encode_batch_map(
        KVEventBatch(1.0, [_one_stored([1] * ROOM)])
    ),
    "one event of 64-byte hashes": lambda: encode_batch(
        KVEventBatch(1.0, [BlockRemoved([b"h" * 64] * (ROOM // 66))])
    ),
    "16 events just under a slice of 1-byte ids": lambda: encode_batch(
        KVEventBatch(1.0, [_one_stored([-1] * (DECODE_SLICE_BYTES - 64))] * 16)
    ),
    "one event of ids of 5 bytes (vLLM's, over 65,535)": lambda: encode_batch(
        KVEventBatch(1.0, [_one_stored([100_000] * (ROOM // 5))])
    ),
    "8,192 removals of a block": lambda: encode_batch(
        KVEventBatch(1.0, [BlockRemoved([i]) for i in range(kv_events.MAX_BATCH_EVENTS)])
    ),
}


@pytest.mark.parametrize("shape", HOSTILE)
async def test_a_4_mib_batch_of_any_shape_is_read_at_most_a_slice_of_bytes_a_turn(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever values make a batch up, no turn of the loop reads more than a slice of it (and
    the other fields of a large event, `MAX_IGNORED_BYTES` at most, around it): neither the
    pass that found the batch's events (the whole payload in one turn) nor the one that found
    a large event's arrays (the whole event) is left, and a slice of 64-byte hashes is as many
    as fit in a slice of bytes (32,768 of them were 2.2 MB in one turn)."""
    payload = HOSTILE[shape]()
    assert len(payload) <= MAX_BATCH_BYTES
    want = decode_batch(payload)
    turns = msgpack_read_per_turn(monkeypatch)
    try:
        got = await decode_batch_in_slices(payload)
    finally:
        await turns.stop()
    assert got == want
    assert turns.on_loop >= len(payload) - 64  # (all of it read, on the loop)
    assert turns.most_per_turn <= DECODE_SLICE_BYTES + MAX_IGNORED_BYTES, turns.per_turn


def _text(value: str) -> bytes:
    return bytes([0xA0 | len(value)]) + value.encode()


def _fill(unit: bytes) -> bytes:
    """An array of as many `unit`s as fill a batch."""
    count = ROOM // len(unit)
    return b"\xdd" + count.to_bytes(4, "big") + unit * count


_REMOVED = b"\x92" + _text("BlockRemoved") + b"\x91\x07"
_STORED_HEAD = _text("BlockStored") + b"\x90\xc0\x90\x10\xc0\xc0"  # (no blocks, no lora, medium)
UNKNOWN = {
    "the batch's 4th field, of [[]]": b"\x94\xcb" + b"\0" * 8 + b"\x91" + _REMOVED + b"\xc0"
    + _fill(b"\x91\x90"),
    "an event's 8th field, of []": b"\x93\xcb" + b"\0" * 8 + b"\x91" + b"\x98" + _STORED_HEAD
    + _fill(b"\x90") + b"\xc0",
    "an event's field named otherwise, of {}": b"\x93\xcb" + b"\0" * 8 + b"\x91" + b"\x83"
    + _text("type") + _text("BlockRemoved") + _text("block_hashes") + b"\x90"
    + _text("extra") + _fill(b"\x80") + b"\xc0",
}  # fmt: skip


@pytest.mark.parametrize("shape", UNKNOWN)
async def test_a_batch_with_4_mib_of_fields_no_reader_knows_is_refused_before_they_are_skipped(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fields a reader ignores are skipped whatever they hold: 4 MiB of empty arrays took one
    pass of 10-18 ms. A batch read in slices with more than `MAX_IGNORED_BYTES` of them after its
    events, or an event over a slice with more besides its arrays, is refused (a loss, as an
    unreadable batch), having read at most a slice and that many bytes."""
    payload = UNKNOWN[shape]
    assert DECODE_SLICE_BYTES < len(payload) <= MAX_BATCH_BYTES
    decode_batch(payload)  # (one call reads it: 4 MiB it skips in one step)
    turns = msgpack_read_per_turn(monkeypatch)
    try:
        with pytest.raises(
            msgspec.DecodeError, match=f"{MAX_IGNORED_BYTES} bytes|over {MAX_IGNORED_BYTES}"
        ):
            await decode_batch_in_slices(payload)
    finally:
        await turns.stop()
    assert turns.on_loop <= DECODE_SLICE_BYTES + MAX_IGNORED_BYTES, turns.per_turn
