"""`decode_batch_in_slices` reads what one `decode_batch` call reads, a bounded slice of work a
turn of the event loop: at most `DECODE_SLICE_BYTES` and `DECODE_SLICE_EVENTS` of events, and
one event alone over the bytes (a long prefill's `BlockStored`) `DECODE_SLICE_ELEMENTS` of its
arrays' elements at a time. A bad element anywhere makes its batch unreadable, as it did."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from shoal.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    encode_batch_map,
)
from shoal.kv import events as kv_events
from shoal.kv import sliced as kv_sliced
from shoal.kv.sliced import DECODE_SLICE_BYTES, decode_batch_in_slices
from shoal.kv.subscription import MAX_BATCH_BYTES
from tests.helpers import LoopTurns
from tests.kv import hostile_batches

FORMS = [encode_batch, encode_batch_map]


def prefill(tokens: int, hashes: str = "int", block_size: int = 16) -> BlockStored:
    """The `BlockStored` vLLM publishes for a prompt of `tokens` tokens (ids of 5 bytes)."""
    ids = [100_000 + (j * 7_919) % 28_000 for j in range(tokens)]
    blocks = range(1, tokens // block_size + 1)
    named = [b.to_bytes(32, "big") for b in blocks] if hashes == "bytes" else list(blocks)
    return BlockStored(named, None, ids, block_size)


def work_per_turn() -> tuple[LoopTurns, LoopTurns]:
    """(events decoded a turn of the loop, elements of one event's arrays decoded a turn)."""
    events = LoopTurns().wrap(kv_sliced, "decode_batch", kv_events.declared_events)
    events.wrap(kv_sliced, "decode_events", lambda raws, *_: len(raws))
    elements = LoopTurns().wrap(kv_sliced, "decode_elements", lambda _, count, *__: count)
    return events, elements


@pytest.mark.parametrize("encode", FORMS)
@pytest.mark.parametrize("hashes", ["int", "bytes"])
async def test_a_128k_token_prefill_event_decodes_as_one_call_reads_it(
    encode: Callable[[KVEventBatch], bytes], hashes: str
) -> None:
    """One `BlockStored` of a 128k-token prompt is ~650 KB: it was refused (a `DecodeError`),
    as every event over `DECODE_SLICE_BYTES`. Now its arrays are decoded a slice of
    `DECODE_SLICE_ELEMENTS` at a time, and it reads as one call reads it, between the events
    around it."""
    big = prefill(131_072, hashes)
    batch = KVEventBatch(2.5, [BlockRemoved([7]), big, BlockStored([9], 8, [1, 2], 2)], 3)
    payload = encode(batch)
    assert DECODE_SLICE_BYTES < len(payload) <= MAX_BATCH_BYTES
    events, elements = work_per_turn()
    try:
        got = await decode_batch_in_slices(payload)
    finally:
        await events.stop()
        await elements.stop()
    assert got == decode_batch(payload)
    assert got.events[1].token_ids == big.token_ids
    assert elements.on_loop == len(big.token_ids) + len(big.block_hashes)
    assert elements.most_per_turn <= kv_sliced.DECODE_SLICE_ELEMENTS
    assert elements.off_loop == events.off_loop == 0


async def test_a_4_mb_event_of_one_token_blocks_is_decoded_a_slice_of_elements_a_turn() -> None:
    """The largest event a batch can hold: as many hashes as token ids (blocks of one token),
    both arrays sliced."""
    big = prefill(380_000, block_size=1)
    payload = encode_batch(KVEventBatch(1.0, [big]))
    assert 3 << 20 < len(payload) <= MAX_BATCH_BYTES
    events, elements = work_per_turn()
    try:
        got = await decode_batch_in_slices(payload)
    finally:
        await events.stop()
        await elements.stop()
    assert got == decode_batch(payload)
    assert elements.on_loop == 2 * 380_000
    assert elements.most_per_turn <= kv_sliced.DECODE_SLICE_ELEMENTS


@pytest.mark.parametrize("encode", FORMS)
async def test_a_batch_of_many_tiny_events_is_decoded_a_bounded_count_of_events_a_turn(
    encode: Callable[[KVEventBatch], bytes],
) -> None:
    """8,192 removals of one block each fit in ~170 KB, one slice of bytes: decoded in one call
    (1-2 ms on a busy machine: a Python call and a few objects an event). Now a slice holds at
    most `DECODE_SLICE_EVENTS` events too."""
    tiny = [BlockRemoved([i]) for i in range(kv_events.MAX_BATCH_EVENTS)]
    payload = encode(KVEventBatch(1.0, tiny))
    assert len(payload) < DECODE_SLICE_BYTES or encode is encode_batch_map  # (32-byte hashes)
    events, elements = work_per_turn()
    try:
        got = await decode_batch_in_slices(payload)
    finally:
        await events.stop()
        await elements.stop()
    assert got == decode_batch(payload)
    assert events.on_loop == len(tiny)
    assert events.most_per_turn <= kv_sliced.DECODE_SLICE_EVENTS, events.per_turn
    assert len(tiny) > kv_sliced.DECODE_SLICE_EVENTS


def _raw_int(value: int, kind: int, width: int) -> msgspec.Raw:
    """`value` in a longer msgpack form than needed (a publisher may write one)."""
    return msgspec.Raw(bytes([kind]) + value.to_bytes(width, "big", signed=kind >= 0xD0))


def _raw_bin(value: bytes, kind: int, width: int) -> msgspec.Raw:
    return msgspec.Raw(bytes([kind]) + len(value).to_bytes(width, "big") + value)


def _random_event(rnd: random.Random, tagged: bool) -> Any:
    """An event as plain msgpack values, its ints and bytes in any form msgpack allows."""

    def number() -> Any:
        value = rnd.choice([0, 5, 127, 200, 70_000, 1 << 40, -3, -100, -40_000])
        if rnd.random() < 0.3:  # (8 bytes: longer than any of these needs)
            return _raw_int(value, 0xD3 if value < 0 else 0xCF, 8)
        return value

    def block_hash() -> Any:
        if rnd.random() < 0.5:
            return number()
        value = rnd.randbytes(rnd.choice([0, 1, 32, 64]))
        if rnd.random() < 0.3:
            return _raw_bin(value, *rnd.choice([(0xC5, 2), (0xC6, 4)]))
        return value

    kind = rnd.choice(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"])
    blocks = rnd.choice([0, 1, 3, 40])
    hashes = [block_hash() for _ in range(blocks)]
    if kind == "AllBlocksCleared":
        return {"type": "AllBlocksCleared"} if tagged else ["AllBlocksCleared"]
    if kind == "BlockRemoved":
        return {"type": "BlockRemoved", "block_hashes": hashes} if tagged else [kind, hashes]
    tokens = [number() for _ in range(blocks * 2 + rnd.choice([0, 1]))]
    parent = rnd.choice([None, block_hash()])
    if tagged:
        fields = {"block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens}
        return {"type": "BlockStored", **fields, "block_size": 2}
    return ["BlockStored", hashes, parent, tokens, 2, None, rnd.choice([None, "GPU"])]


@pytest.mark.parametrize("seed", range(40))
async def test_random_batches_read_in_small_slices_as_one_call_reads_them(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slices of a few bytes, events and elements (so every event is "over a slice" and every
    array cut): every batch decodes to what `decode_batch` makes of it, a corrupted one is
    refused when `decode_batch` refuses it."""
    monkeypatch.setattr(kv_sliced, "DECODE_SLICE_BYTES", 64)
    monkeypatch.setattr(kv_sliced, "DECODE_SLICE_EVENTS", 3)
    monkeypatch.setattr(kv_sliced, "DECODE_SLICE_ELEMENTS", 4)
    rnd = random.Random(seed)
    tagged = seed % 2 == 1
    events = [_random_event(rnd, tagged) for _ in range(rnd.randrange(1, 12))]
    payload = msgspec.msgpack.encode([1.5, events, 0])
    for data in (payload, *(_corrupt(rnd, payload) for _ in range(20))):
        try:
            want: Any = decode_batch(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            want = "refused"
        try:
            got: Any = await decode_batch_in_slices(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            got = "refused"
        assert got == want, (data, got, want)


def _corrupt(rnd: random.Random, payload: bytes) -> bytes:
    data = bytearray(payload)
    at = rnd.randrange(len(data))
    data[at] = rnd.choice([rnd.randrange(256), 0xA1, 0xC1, 0xDD, 0xC4, 0xCF, 0x90])
    return bytes(data)


@pytest.mark.parametrize("encode", FORMS)
@pytest.mark.parametrize(
    "bad",
    ["a token id that is a string", "a hash over 64 bytes", "token ids that are not an array"],
)
async def test_a_bad_element_deep_in_a_large_event_makes_its_batch_unreadable(
    encode: Callable[[KVEventBatch], bytes], bad: str
) -> None:
    big = prefill(150_000)
    if bad == "a token id that is a string":
        big.token_ids[100_003] = "x"  # type: ignore[call-overload]
    elif bad == "a hash over 64 bytes":
        big.block_hashes[9_000] = b"h" * 65
    else:
        big.token_ids = b"t" * 700_000  # type: ignore[assignment]
    payload = encode(KVEventBatch(1.0, [AllBlocksCleared(), big]))
    assert len(payload) > DECODE_SLICE_BYTES
    with pytest.raises(msgspec.ValidationError):
        decode_batch(payload)
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):  # (a loss either way)
        await decode_batch_in_slices(payload)


async def _read_both(data: bytes) -> tuple[Any, Any]:
    """(what `decode_batch` makes of `data`, what `decode_batch_in_slices` does): a batch, or
    "refused"."""
    try:
        want: Any = decode_batch(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        want = "refused"
    try:
        got: Any = await decode_batch_in_slices(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        got = "refused"
    return want, got


def _text(value: str) -> bytes:
    return bytes([0xA0 | len(value)]) + value.encode()


@pytest.mark.parametrize(
    ("first", "second", "read"),
    [("bad", "good", "refused"), ("good", "bad", "refused"), ("good", "good", "the second")],
)
async def test_a_map_event_over_a_slice_with_token_ids_twice_reads_as_one_call_reads_it(
    first: str, second: str, read: str
) -> None:
    """A tagged-map `BlockStored` over `DECODE_SLICE_BYTES` with `token_ids` twice, one of them
    `[1.5]`: one `decode_batch` call refuses it (msgspec checks every value of a field it
    knows, the last one wins). The sliced read took the first as bytes it did not check and
    applied the second (the hunt of 7 Dec 2026). Now every one is read, as one call reads it."""
    good = [100_000 + i for i in range(70_000)]  # (ids of 5 bytes: ~350 KB)
    values = {"good": msgspec.msgpack.encode(good), "bad": msgspec.msgpack.encode([1.5])}
    event = (
        b"\x88" + _text("type") + _text("BlockStored")
        + _text("token_ids") + values[first]
        + _text("block_hashes") + b"\x91\x07" + _text("parent_block_hash") + b"\xc0"
        + _text("token_ids") + values[second]
        + _text("block_size") + b"\x10" + _text("lora_id") + b"\xc0" + _text("medium") + _text("GPU")
    )  # fmt: skip
    payload = b"\x93\xcb" + b"\0" * 8 + b"\x91" + event + b"\xc0"
    assert len(payload) > DECODE_SLICE_BYTES
    want, got = await _read_both(payload)
    assert got == want
    if read == "refused":
        assert got == "refused"
    else:
        assert got.events[0].token_ids == good


@pytest.mark.parametrize("seed", range(8))
async def test_hostile_random_batches_read_in_slices_as_one_call_reads_them(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches written byte by byte (`tests.kv.hostile_batches`: every form msgpack allows and
    some it refuses, fields twice, headers that lie), read in slices of every size: each reads
    as one `decode_batch` call reads it, or both refuse it."""
    rnd = random.Random(seed)
    for _ in range(60):
        monkeypatch.setattr(kv_sliced, "DECODE_SLICE_BYTES", rnd.choice([16, 64, 300, 1000]))
        monkeypatch.setattr(kv_sliced, "DECODE_SLICE_EVENTS", rnd.choice([1, 2, 3, 1024]))
        monkeypatch.setattr(kv_sliced, "DECODE_SLICE_ELEMENTS", rnd.choice([1, 2, 3, 7, 64]))
        payload = hostile_batches.a_batch(rnd)
        want, got = await _read_both(payload)
        assert got == want, payload
