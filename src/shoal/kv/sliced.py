"""KV event batches decoded a bounded step at a time, yielding to the event loop between steps.

msgspec decodes a whole value in one C call holding the GIL, so a thread would not spare the
loop: 4 MiB of token ids is 30-90 ms in one call. A batch over `DECODE_SLICE_BYTES` or
`DECODE_SLICE_EVENTS` events is walked by hand along its fixed schema (`shoal.kv.events`):
its events a slice at a time, one event alone over a slice (vLLM publishes one `BlockStored`
a prefill: a 128k-token prompt's is ~680 KB) a slice of its arrays' elements at a time, its
other fields bounded (`MAX_IGNORED_BYTES`). It reads what one `decode_batch` call reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, cast

import msgspec

from shoal.kv import framing
from shoal.kv.events import (
    MAX_BATCH_EVENTS,
    MAX_HASH_BYTES,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    TaggedAllBlocksCleared,
    TaggedBlockRemoved,
    TaggedBlockStored,
    batch_head,
    declared_events,
    decode_batch,
    untagged,
)

DECODE_SLICE_BYTES = 256 << 10
"""The most bytes of a batch decoded (or skipped) in one step on the event loop: ~1 ms of ids of 5 bytes, 2
of 3 bytes (those under 65,536: 512 KiB of them took 4-6 ms), 3.7 of the densest ints msgpack
has (2 bytes, not cached by Python), on a busy 2-core machine. msgspec decodes in one C call
holding the GIL, so a thread would not spare the loop: a larger batch is decoded by
`decode_batch_in_slices`, a slice of events at a time, and one event larger than this (vLLM
publishes one `BlockStored` a prefill: a 128k-token prompt's is ~680 KB) a slice of its
arrays' elements at a time."""
DECODE_SLICE_EVENTS = 1024
"""And the most events decoded in one step: each is a Python call and a few objects, so a slice
of tiny ones does more work than its bytes say (8,192 removals of one block: ~170 KB, 1.5-2 ms
in one call); 1,024 events of 16 token ids take ~0.6 ms."""
DECODE_SLICE_ELEMENTS = 32_768
"""The most elements (token ids, block hashes) of one event's array decoded in one step, for an
event alone over `DECODE_SLICE_BYTES`: ~0.5 ms, and as long again to find where they end; and
no more than fit in `DECODE_SLICE_BYTES` at their widest (a hash of 64 bytes takes 69: 3,799
of them; 32,768 such were 2.2 MB, 5-6 ms a step)."""
MAX_IGNORED_BYTES = 64 << 10
"""The most bytes of a batch decoded in slices after its events (`data_parallel_rank`, fields a
reader ignores), and of an event over `DECODE_SLICE_BYTES` besides its arrays of hashes and
token ids (its other fields): each is read whole (vLLM's take a few bytes), and skipping a
value costs per value it holds, not per byte (4 MiB of empty arrays in a field no reader knows:
10-22 ms in one call). A batch with more is refused (a loss) before they are read."""
MAX_LARGE_FIELDS = 64
"""The most fields (items of its array, pairs of its map) of an event over `DECODE_SLICE_BYTES`:
each is looked at by hand (vLLM's have 7 or 8)."""


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch with its events left encoded: its fields read from a stand-in without them."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_raw_decoder = msgspec.msgpack.Decoder(_RawBatch)
_raws_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_event_decoder = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
_map_event_decoder = msgspec.msgpack.Decoder(
    TaggedBlockStored | TaggedBlockRemoved | TaggedAllBlocksCleared
)


def decoded_at_once(payload: bytes) -> bool:
    """Whether `decode_batch_in_slices(payload)` decodes it in one step (one slice: at most
    `DECODE_SLICE_BYTES` and `DECODE_SLICE_EVENTS` events)."""
    return len(payload) <= DECODE_SLICE_BYTES and declared_events(payload) <= DECODE_SLICE_EVENTS


async def decode_batch_in_slices(payload: bytes) -> KVEventBatch:
    """`decode_batch(payload)`, yielding to the event loop between steps that each skip or
    decode at most `DECODE_SLICE_BYTES` (and `DECODE_SLICE_EVENTS` events, or
    `DECODE_SLICE_ELEMENTS` elements of an array). msgspec skips a value at a cost per value
    it holds, not per byte (one pass over 4 MiB of 1-byte ids or empty arrays held the loop
    9-18 ms), so a batch more than one slice is walked by hand along its fixed schema: its
    events a slice at a time (`_decode_slice`), an event alone over a slice by
    `_decode_large`, then its fields after the events (`data_parallel_rank` and any a reader
    ignores), at most `MAX_IGNORED_BYTES`, with its `ts`."""
    if decoded_at_once(payload):
        return decode_batch(payload)
    head = batch_head(payload)
    if head is None:
        raise msgspec.DecodeError("KV event batch: not an array of a time and events")
    events, events_at, at = head
    if events > MAX_BATCH_EVENTS:
        raise msgspec.DecodeError(f"KV event batch: {events} events, over {MAX_BATCH_EVENTS}")
    data = memoryview(payload)
    decoded: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    try:
        at = await _decode_all(data, at, events, decoded)
        if len(data) - at > MAX_IGNORED_BYTES:
            raise msgspec.DecodeError(
                f"KV event batch: {len(data) - at} bytes after its events, over {MAX_IGNORED_BYTES}"
            )
        fields = _raw_decoder.decode(payload[:events_at] + b"\x90" + payload[at:])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        await _let_go(a for e in decoded if not isinstance(e, AllBlocksCleared) for a in _arrays(e))
        if isinstance(exc, RecursionError):
            raise msgspec.DecodeError("KV event batch: values nested too deeply") from None
        raise
    return KVEventBatch(fields.ts, decoded, fields.data_parallel_rank)


async def _decode_all(
    data: memoryview,
    at: int,
    events: int,
    into: list[BlockStored | BlockRemoved | AllBlocksCleared],
) -> int:
    """Decode the `events` events from `at` onto `into`, a slice at a time; where they end. How
    many events fit in a slice is known once they are read: a slice of as many as the last
    (twice as many when they fit), half as many when they do not fit in its bytes."""
    tagged: bool | None = None  # (the form, as the first event shows it)
    group = DECODE_SLICE_EVENTS
    while len(into) < events:
        group = min(group, events - len(into))
        end = framing.values_end(data, at, group, DECODE_SLICE_BYTES)
        await asyncio.sleep(0)
        if end is None and at + DECODE_SLICE_BYTES >= len(data):
            raise msgspec.DecodeError("KV event batch: truncated")
        if end is None and group > 1:
            group //= 2
        elif end is None:  # (it yields after each of its steps)
            large, at, tagged = await _decode_large(data, at, tagged)
            into.append(large)
            await asyncio.sleep(0)
        else:
            tagged = _decode_slice(data[at:end], group, into, tagged)
            group, at = min(2 * group, DECODE_SLICE_EVENTS), end
            await asyncio.sleep(0)
    return at


def _decode_slice(
    body: memoryview,
    count: int,
    into: list[BlockStored | BlockRemoved | AllBlocksCleared],
    tagged: bool | None,
) -> bool | None:
    """Decode the `count` events written one after the other in `body` onto `into`; the
    batch's form (None: not known yet)."""
    raws = _raws_decoder.decode(b"\xdd" + count.to_bytes(4, "big") + body)
    events, tagged = decode_events(raws, tagged)
    into.extend(events)
    return tagged


def decode_events(
    events: list[msgspec.Raw], tagged: bool | None = None
) -> tuple[list[BlockStored | BlockRemoved | AllBlocksCleared], bool]:
    """`events` decoded, in the batch's form: `tagged` maps or arrays (None: as the first
    event shows, the array form tried first as `decode_batch` does); and that form."""
    out = []
    try:
        for event in events:
            if tagged is None:
                try:
                    out.append(_event_decoder.decode(event))
                    tagged = False
                    continue
                except msgspec.ValidationError as exc:
                    try:
                        out.append(untagged(_map_event_decoder.decode(event)))
                    except msgspec.ValidationError:
                        raise exc from None
                    tagged = True
                    continue
            if tagged:
                out.append(untagged(_map_event_decoder.decode(event)))
            else:
                out.append(_event_decoder.decode(event))
    except RecursionError:
        raise msgspec.DecodeError("KV event batch: values nested too deeply") from None
    return out, bool(tagged)


_ids_decoder = msgspec.msgpack.Decoder(list[int])
_hashes_decoder = msgspec.msgpack.Decoder(list[BlockHash])
_HASH = framing.bin_of(MAX_HASH_BYTES) + b"|" + framing.INT
"""A block hash (`BlockHash`): an int or at most `MAX_HASH_BYTES` bytes, in any of their forms."""
_Elements = tuple[bytes, msgspec.msgpack.Decoder[list[Any]], int]
"""An array's elements: the pattern of their forms, their decoder, the bytes of the widest."""
_HASHES: _Elements = (_HASH, _hashes_decoder, 5 + MAX_HASH_BYTES)
_IDS: _Elements = (framing.INT, _ids_decoder, 9)
_ARRAY_AT = {1: _HASHES, 3: _IDS}
"""Where an event in the array form has its arrays (`BlockStored`'s, `BlockRemoved`'s first)."""
_ARRAY_NAMED = {"block_hashes": _HASHES, "token_ids": _IDS}


async def _decode_large(
    data: memoryview, at: int, tagged: bool | None
) -> tuple[BlockStored | BlockRemoved | AllBlocksCleared, int, bool]:
    """The event alone over `DECODE_SLICE_BYTES` at `at` of `data` (in the batch's form, as
    `decode_events` reads it) and where it ends, walked by hand, yielding after each step.

    Its arrays of hashes and token ids, wherever they may be (items 1 and 3 of an array,
    `block_hashes` and `token_ids` of a map, each time one is given), are read a slice of
    elements at a time (`_decode_array`). Every other field, `MAX_IGNORED_BYTES` at most in
    all, is copied into a stand-in of the event where each of those arrays is `[its number]`,
    which `decode_events` decodes: so msgspec judges the event's type, its fields, and which
    value of a field given twice counts, as one call judges them; only the arrays are read
    here (an element matches `_HASH` or `framing.INT` exactly when their decoder takes it)."""
    head = framing.container(data, at)
    if head is None:
        raise msgspec.ValidationError("KV event batch: an event is neither an array nor a map")
    is_map, fields, inside = head
    if fields > MAX_LARGE_FIELDS:
        raise msgspec.DecodeError(
            f"KV event batch: an event over {DECODE_SLICE_BYTES} bytes of {fields} fields,"
            f" over {MAX_LARGE_FIELDS}"
        )
    stand_in, arrays = [bytes(data[at:inside])], list[list[Any]]()
    try:
        return await _walk_large(data, inside, fields, is_map, stand_in, arrays, tagged)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        await _let_go(arrays)
        raise


async def _walk_large(
    data: memoryview,
    at: int,
    fields: int,
    is_map: bool,
    stand_in: list[bytes],
    arrays: list[list[Any]],
    tagged: bool | None,
) -> tuple[BlockStored | BlockRemoved | AllBlocksCleared, int, bool]:
    """`_decode_large`'s walk of the `fields` of an event from `at`: its arrays decoded onto
    `arrays`, the rest onto `stand_in`."""
    left = MAX_IGNORED_BYTES
    for field in range(fields):
        array = _ARRAY_AT.get(field)
        if is_map:
            key, at, left = _other_field(data, at, left)
            stand_in.append(key)
            name = msgspec.msgpack.decode(key)
            array = _ARRAY_NAMED.get(name) if isinstance(name, str) else None
        read = await _decode_array(data, at, *array) if array else None
        if read is None:
            value, at, left = _other_field(data, at, left)
            stand_in.append(value)
            continue
        arrays.append(read[0])
        stand_in.append(b"\x91\xce" + (len(arrays) - 1).to_bytes(4, "big"))
        at = read[1]
    [event], tagged = decode_events([msgspec.Raw(b"".join(stand_in))], tagged)
    if isinstance(event, BlockStored | BlockRemoved):
        event.block_hashes = arrays[cast(int, event.block_hashes[0])]
    if isinstance(event, BlockStored):
        event.token_ids = arrays[event.token_ids[0]]
    return event, at, tagged


def _other_field(data: memoryview, at: int, left: int) -> tuple[bytes, int, int]:
    """(the value at `at`, where it ends, the bytes `left` for others after it) for a field of a
    large event besides its arrays; refused (a `DecodeError`) when it is over `left`."""
    end = framing.values_end(data, at, 1, left)
    if end is None:
        raise msgspec.DecodeError(
            f"KV event batch: an event over {DECODE_SLICE_BYTES} bytes with {MAX_IGNORED_BYTES}"
            " bytes of fields besides its arrays, or an element of them that is not one"
        )
    return bytes(data[at:end]), end, left - (end - at)


async def _decode_array(
    data: memoryview,
    at: int,
    element: bytes,
    decoder: msgspec.msgpack.Decoder[list[Any]],
    widest: int,
) -> tuple[list[Any], int] | None:
    """(the msgpack array at `at`, where it ends), decoded `DECODE_SLICE_ELEMENTS` elements at a
    time, and no more than fit in `DECODE_SLICE_BYTES` at their `widest`, yielding after each
    slice; None if it is not an array of `element`s (a pattern of each form its elements may
    take). msgspec decodes a whole value or nothing, so where a slice ends is found by
    `element` (`framing.elements_end`)."""
    head = framing.container(data, at)
    if head is None or head[0]:
        return None
    _, count, at = head
    most = min(DECODE_SLICE_ELEMENTS, max(1, DECODE_SLICE_BYTES // widest))
    out: list[Any] = []
    while count:
        step = min(count, most)
        end = framing.elements_end(element, data, at, step)
        if end is None:
            await _let_go([out])
            return None
        out += decode_elements(decoder, step, data[at:end])
        count, at = count - step, end
        await asyncio.sleep(0)
    return out, at


def _arrays(event: BlockStored | BlockRemoved) -> tuple[list[Any], ...]:
    return (
        (event.block_hashes, event.token_ids)
        if isinstance(event, BlockStored)
        else (event.block_hashes,)
    )


async def _let_go(arrays: Iterable[list[Any]]) -> None:
    """Empty `arrays` (decoded, then refused) `DECODE_SLICE_ELEMENTS` elements a step, yielding
    between: 4 million ints freed at once held the loop 5-9 ms."""
    held = 0
    for array in arrays:
        while array:
            held += min(len(array), DECODE_SLICE_ELEMENTS)
            del array[-DECODE_SLICE_ELEMENTS:]
            if held >= DECODE_SLICE_ELEMENTS:
                held = 0
                await asyncio.sleep(0)


def decode_elements(
    decoder: msgspec.msgpack.Decoder[list[Any]], count: int, body: memoryview
) -> list[Any]:
    """The `count` msgpack values written one after the other in `body` (a slice of an array's
    elements), decoded by `decoder` as the array they are."""
    return decoder.decode(b"\xdd" + count.to_bytes(4, "big") + body)
