"""KV cache events as vLLM publishes them, so shoal and vLLM workers interoperate.

The wire format (vLLM's `vllm.distributed.kv_events`, read from its published schema):

- a ZMQ PUB socket sends three-frame messages `[topic, seq, payload]`: `seq` is an 8-byte
  big-endian sequence number, one per batch, increasing by one; `payload` is a msgpack
  `KVEventBatch`, encoded as an array `[ts, events, data_parallel_rank]`;
- each event is an array whose first item names its type: `["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium]`, `["BlockRemoved",
  block_hashes, medium]`, `["AllBlocksCleared"]`; trailing fields a reader does not know
  are ignored, and missing trailing ones take their defaults (older and newer vLLMs);
- a ZMQ ROUTER replay socket answers a request holding an 8-byte start sequence number
  with every buffered `[seq, payload]` from there on, then `[-1 as 8 signed bytes, b""]`.

Block hashes are opaque engine values (an int or bytes, at most `MAX_HASH_BYTES`): only
equality matters.

The tagged-map form (vLLM 0.28 on, and what vllm-router's `kv_aware` decodes): the batch is the
same array, but each event is a msgpack map, its type under `"type"` and each field under its
name (`lora_id`, `medium` and `lora_name` always present, possibly nil). `encode_batch_map`
writes it for such readers: block hashes as 32 bytes (vllm-router admits only the size of
vLLM's sha256 digests), `medium` `"GPU"` when unset. `decode_batch` reads both forms.
"""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Annotated, Any

import msgspec

MAX_HASH_BYTES = 64
"""The longest engine block hash read (vLLM's are 32 bytes): hashes are index keys, and the
index is bounded in blocks, so 4 KB hashes made ~1 GiB an instance. A longer one makes its
batch unreadable (a `ValidationError`: a loss)."""
BlockHash = int | Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]
MAX_BATCH_EVENTS = 8192
"""The most events a batch may hold: decoding is one step on the event loop, ~0.2-1.5 us an
event (8,192 take 1.5-12 ms); vLLM reports an evicted block an event, so this is a step
evicting 128K tokens in blocks of 16. A batch declaring more is refused before it is decoded
(250,000 empty events fit in 4 MiB: 70-230 ms)."""
DECODE_SLICE_BYTES = 256 << 10
"""The most bytes of a batch decoded in one step on the event loop: ~1 ms of ids of 5 bytes, 2
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
event alone over `DECODE_SLICE_BYTES`: ~0.5 ms, and as long again to find where they end."""
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the last message of a replay (its payload is empty)."""


class KvEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to an engine's KV cache; the tag (the class name) comes first on the wire."""


class BlockStored(KvEvent):
    """Full blocks were computed and cached: `token_ids` holds `block_size` ids per block,
    and `parent_block_hash` names the block before the first one (None: the prompt starts)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KvEvent):
    """Blocks were evicted."""

    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(KvEvent):
    """The engine dropped its whole cache (reset, restart)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: the events of one engine step, in order."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KvEndpoint(msgspec.Struct, frozen=True, forbid_unknown_fields=False, gc=False):
    """Where a worker publishes its KV events, as advertised in its discovery record; both
    sockets are checked (`check_zmq_endpoint`) when it is built or decoded."""

    publisher: str
    """The PUB socket, e.g. `tcp://10.0.0.5:5557`."""
    replay: str = ""
    """The ROUTER replay socket; empty when the publisher cannot replay."""
    topic: str = ""

    def __post_init__(self) -> None:
        check_zmq_endpoint(self.publisher)
        if self.replay:
            check_zmq_endpoint(self.replay)


_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.*-]+):([0-9]{1,5})")
MAX_ENDPOINT = 512


def check_zmq_endpoint(endpoint: str) -> str:
    """`endpoint` if ZMQ can connect to it: `tcp://host:port` (port 1-65535) or
    `ipc://path`; ValueError naming what is wrong otherwise."""
    if len(endpoint) > MAX_ENDPOINT:
        raise ValueError(f"a ZMQ endpoint is at most {MAX_ENDPOINT} characters")
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    match = _TCP.fullmatch(endpoint)
    if match is None:
        raise ValueError(f"{endpoint!r} is not a ZMQ endpoint like tcp://host:port or ipc://path")
    if not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"{endpoint!r}: the port must be 1-65535")
    return endpoint


WIRE_FORMATS = ("array", "map")
"""How a publisher encodes its events: `array` (vLLM's tagged arrays, shoal's own default),
`map` (tagged maps: vLLM 0.28 on, vllm-router)."""
MEDIUM_GPU = "GPU"


class TaggedBlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    """`BlockStored` in the tagged-map form (fields vLLM declares without a default are
    always written, as vLLM writes them)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class TaggedBlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None


class TaggedAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class TaggedKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch whose events are tagged maps; the batch itself is the same array."""

    ts: float
    events: list[TaggedBlockStored | TaggedBlockRemoved | TaggedAllBlocksCleared]
    data_parallel_rank: int | None = None


_MASK64 = (1 << 64) - 1


def wire_hash(block_hash: BlockHash) -> bytes:
    """`block_hash` as the 32 bytes the tagged-map form carries: bytes as they are, an int
    by its 64 bits (two's complement), big-endian, zero-padded. One-to-one on 64-bit ints,
    so equal hashes stay equal and different ones different."""
    if isinstance(block_hash, bytes):
        return block_hash
    return (block_hash & _MASK64).to_bytes(32, "big")


def _tagged(
    event: BlockStored | BlockRemoved | AllBlocksCleared,
) -> TaggedBlockStored | TaggedBlockRemoved | TaggedAllBlocksCleared:
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return TaggedBlockStored(
            block_hashes=[wire_hash(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else wire_hash(parent),
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium or MEDIUM_GPU,
        )
    if isinstance(event, BlockRemoved):
        return TaggedBlockRemoved(
            block_hashes=[wire_hash(h) for h in event.block_hashes],
            medium=event.medium or MEDIUM_GPU,
        )
    return TaggedAllBlocksCleared()


def _untagged(
    event: TaggedBlockStored | TaggedBlockRemoved | TaggedAllBlocksCleared,
) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(event, TaggedBlockStored):
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
        )
    if isinstance(event, TaggedBlockRemoved):
        return BlockRemoved(block_hashes=event.block_hashes, medium=event.medium)
    return AllBlocksCleared()


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_map_decoder = msgspec.msgpack.Decoder(TaggedKVEventBatch)


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch with its events left encoded (each a view of the payload: nothing copied)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_raw_decoder = msgspec.msgpack.Decoder(_RawBatch)
_event_decoder = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
_map_event_decoder = msgspec.msgpack.Decoder(
    TaggedBlockStored | TaggedBlockRemoved | TaggedAllBlocksCleared
)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def encode_batch_map(batch: KVEventBatch) -> bytes:
    """`batch` in the tagged-map form (see the module's docstring)."""
    events = [_tagged(e) for e in batch.events]
    return _encoder.encode(TaggedKVEventBatch(batch.ts, events, batch.data_parallel_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack payload; `msgspec.DecodeError` (or ValidationError) if malformed.

    Depth: every field the schema knows has a fixed shape, so a nested value where one is
    expected is a `ValidationError` at once; only the trailing fields a reader ignores are
    skipped whatever they hold. Binary msgpack has no brackets for `shoal.bounds` to count,
    so a payload nested past the interpreter's recursion limit there (called from the same
    shallow frame of the subscriber every time) is answered as the `DecodeError` it is.

    The tagged-map form is tried only when the array form does not fit (a map where an
    event's array is expected fails on the first event), so array batches cost what they did.
    """
    events = declared_events(payload)
    if events > MAX_BATCH_EVENTS:
        raise msgspec.DecodeError(f"KV event batch: {events} events, over {MAX_BATCH_EVENTS}")
    try:
        try:
            return _decoder.decode(payload)
        except msgspec.ValidationError as exc:
            try:
                tagged = _map_decoder.decode(payload)
            except msgspec.ValidationError:
                raise exc from None
        return KVEventBatch(
            tagged.ts, [_untagged(e) for e in tagged.events], tagged.data_parallel_rank
        )
    except RecursionError:
        raise msgspec.DecodeError("KV event batch: values nested too deeply") from None


def decoded_at_once(payload: bytes) -> bool:
    """Whether `decode_batch_in_slices(payload)` decodes it in one step (one slice: at most
    `DECODE_SLICE_BYTES` and `DECODE_SLICE_EVENTS` events)."""
    return len(payload) <= DECODE_SLICE_BYTES and declared_events(payload) <= DECODE_SLICE_EVENTS


async def decode_batch_in_slices(payload: bytes) -> KVEventBatch:
    """`decode_batch(payload)`, yielding to the event loop between slices of at most
    `DECODE_SLICE_BYTES` and `DECODE_SLICE_EVENTS` events: the batch's array is read first with
    its events left encoded (one pass that skips them), then its events are decoded a slice at
    a time (`decode_events`), and an event alone over `DECODE_SLICE_BYTES` a slice of its
    arrays' elements at a time (`_decode_large`)."""
    if decoded_at_once(payload):
        return decode_batch(payload)
    events = declared_events(payload)
    if events > MAX_BATCH_EVENTS:
        raise msgspec.DecodeError(f"KV event batch: {events} events, over {MAX_BATCH_EVENTS}")
    try:
        raw = _raw_decoder.decode(payload)
    except RecursionError:
        raise msgspec.DecodeError("KV event batch: values nested too deeply") from None
    await asyncio.sleep(0)  # (that pass: ~1 ms a MiB)
    decoded: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    tagged: bool | None = None  # (the form, as the first event shows it)
    piece: list[msgspec.Raw] = []
    held = 0
    for event in raw.events:
        size = len(event)
        if piece and (held + size > DECODE_SLICE_BYTES or len(piece) >= DECODE_SLICE_EVENTS):
            tagged = _decode_piece(piece, decoded, tagged)
            piece, held = [], 0
            await asyncio.sleep(0)
        if size > DECODE_SLICE_BYTES:  # (it yields after each of its steps)
            large, tagged = await _decode_large(event, tagged)
            decoded.append(large)
            continue
        piece.append(event)
        held += size
    _decode_piece(piece, decoded, tagged)
    return KVEventBatch(raw.ts, decoded, raw.data_parallel_rank)


def _decode_piece(
    piece: list[msgspec.Raw],
    into: list[BlockStored | BlockRemoved | AllBlocksCleared],
    tagged: bool | None,
) -> bool | None:
    """Decode `piece` onto `into`; the batch's form (None: not known yet)."""
    if piece:
        events, tagged = decode_events(piece, tagged)
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
                        out.append(_untagged(_map_event_decoder.decode(event)))
                    except msgspec.ValidationError:
                        raise exc from None
                    tagged = True
                    continue
            if tagged:
                out.append(_untagged(_map_event_decoder.decode(event)))
            else:
                out.append(_event_decoder.decode(event))
    except RecursionError:
        raise msgspec.DecodeError("KV event batch: values nested too deeply") from None
    return out, bool(tagged)


class _LargeStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    """A `BlockStored` with its arrays left encoded (views of the payload: nothing copied)."""

    block_hashes: msgspec.Raw
    parent_block_hash: BlockHash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _LargeRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: msgspec.Raw
    medium: str | None = None


class _LargeTaggedStored(msgspec.Struct, tag="BlockStored", gc=False):
    """`_LargeStored` in the tagged-map form."""

    block_hashes: msgspec.Raw
    parent_block_hash: BlockHash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _LargeTaggedRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: msgspec.Raw
    medium: str | None = None


_large_decoder = msgspec.msgpack.Decoder(_LargeStored | _LargeRemoved | AllBlocksCleared)
_map_large_decoder = msgspec.msgpack.Decoder(
    _LargeTaggedStored | _LargeTaggedRemoved | TaggedAllBlocksCleared
)
_ids_decoder = msgspec.msgpack.Decoder(list[int])
_hashes_decoder = msgspec.msgpack.Decoder(list[BlockHash])


async def _decode_large(
    event: msgspec.Raw, tagged: bool | None
) -> tuple[BlockStored | BlockRemoved | AllBlocksCleared, bool]:
    """An event alone over `DECODE_SLICE_BYTES` (in the batch's form, as `decode_events` reads
    it), yielding after each step: its fields with its arrays left encoded (one pass that skips
    them), then each array `DECODE_SLICE_ELEMENTS` elements at a time (`_decode_array`)."""
    try:
        if tagged:
            outer: Any = _map_large_decoder.decode(event)
        else:
            try:
                outer = _large_decoder.decode(event)
                tagged = False
            except msgspec.ValidationError as exc:
                if tagged is not None:
                    raise
                try:
                    outer = _map_large_decoder.decode(event)
                except msgspec.ValidationError:
                    raise exc from None
                tagged = True
    except RecursionError:
        raise msgspec.DecodeError("KV event batch: values nested too deeply") from None
    await asyncio.sleep(0)
    if isinstance(outer, AllBlocksCleared | TaggedAllBlocksCleared):
        return AllBlocksCleared(), bool(tagged)
    hashes = await _decode_array(outer.block_hashes, _hashes_decoder, _HASH)
    if isinstance(outer, _LargeRemoved | _LargeTaggedRemoved):
        return BlockRemoved(hashes, outer.medium), bool(tagged)
    ids = await _decode_array(outer.token_ids, _ids_decoder, _INT)
    stored = BlockStored(hashes, outer.parent_block_hash, ids, outer.block_size)
    stored.lora_id, stored.medium = outer.lora_id, outer.medium
    return stored, bool(tagged)


async def _decode_array(
    raw: msgspec.Raw, decoder: msgspec.msgpack.Decoder[list[Any]], element: bytes
) -> list[Any]:
    """The msgpack array `raw` decoded `DECODE_SLICE_ELEMENTS` elements at a time, yielding after
    each slice. msgspec decodes a whole value or nothing, so where a slice ends is found by
    `element`, a pattern matching each form its elements may take (a C loop of `re`, ~15 ns
    an element); an element it does not match is decoded with all those after it, in one
    step, and the decoder refuses it there (it matches every form the decoder accepts)."""
    data = memoryview(raw)
    count, at = _array_header(data)
    if at == 0:  # (not an array: the decoder says so)
        return decoder.decode(data)
    out: list[Any] = []
    step = DECODE_SLICE_ELEMENTS
    run = _run_of(element, step)
    while count > step:
        match = run.match(data, at)
        if match is None:
            break
        out += decode_elements(decoder, step, data[at : match.end()])
        count, at = count - step, match.end()
        await asyncio.sleep(0)
    out += decode_elements(decoder, count, data[at:])
    await asyncio.sleep(0)
    return out


def decode_elements(
    decoder: msgspec.msgpack.Decoder[list[Any]], count: int, body: memoryview
) -> list[Any]:
    """The `count` msgpack values written one after the other in `body` (a slice of an array's
    elements), decoded by `decoder` as the array they are."""
    return decoder.decode(b"\xdd" + count.to_bytes(4, "big") + body)


def _array_header(data: memoryview) -> tuple[int, int]:
    """(elements, where the first one starts) of the msgpack array `data`; (0, 0) if it is
    not one."""
    head = data[0] if data else 0
    if 0x90 <= head <= 0x9F:
        return head & 0x0F, 1
    if head in (0xDC, 0xDD) and len(data) >= (width := 2 if head == 0xDC else 4) + 1:
        return int.from_bytes(data[1 : 1 + width], "big"), 1 + width
    return 0, 0


_INT = rb"\xce....|\xcd..|[\x00-\x7f\xe0-\xff]|\xcc.|\xcf.{8}|\xd0.|\xd1..|\xd2.{4}|\xd3.{8}"
"""A msgpack int in any of its forms (the most frequent token ids' first)."""


def _bin(kind: int, width: int) -> bytes:
    """A msgpack bin of type byte `kind` and a length of `width` bytes, at most `MAX_HASH_BYTES`
    long (vLLM's 32 first)."""
    lengths = [32, *(n for n in range(MAX_HASH_BYTES + 1) if n != 32)]
    each = b"|".join(re.escape(n.to_bytes(width, "big")) + b".{%d}" % n for n in lengths)
    return re.escape(bytes([kind])) + b"(?:" + each + b")"


_HASH = b"|".join([_bin(0xC4, 1), _INT, _bin(0xC5, 2), _bin(0xC6, 4)])
"""A block hash (`BlockHash`): an int or at most `MAX_HASH_BYTES` bytes, in any of their forms."""


@functools.cache
def _run_of(element: bytes, count: int) -> re.Pattern[bytes]:
    return re.compile(b"(?:%s){%d}+" % (element, count), re.DOTALL)


# msgpack: the bytes a number takes after its type byte (the types a float field accepts).
_NUMBER_SIZE = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2}
_NUMBER_SIZE |= {0xD2: 4, 0xD3: 8}


def declared_events(payload: bytes) -> int:
    """How many events batch `payload` says it holds (the length of its events array, read
    from the header, before anything is decoded); 0 when the header is not a batch's (the
    decoder refuses it)."""
    at, head = 0, payload[:1]
    if not head:
        return 0
    if 0x90 <= head[0] <= 0x9F:  # the batch: an array, of its length's every form
        at = 1
    elif head[0] in (0xDC, 0xDD):
        at = 3 if head[0] == 0xDC else 5
    else:
        return 0
    ts = payload[at : at + 1]  # ts: a number
    if not ts:
        return 0
    if ts[0] < 0x80 or ts[0] >= 0xE0:  # (a fixint: the type byte is the number)
        at += 1
    elif ts[0] in _NUMBER_SIZE:
        at += 1 + _NUMBER_SIZE[ts[0]]
    else:
        return 0
    if at >= len(payload):
        return 0
    kind = payload[at]  # events: an array
    if 0x90 <= kind <= 0x9F:
        return kind & 0x0F
    if kind in (0xDC, 0xDD):
        width = 2 if kind == 0xDC else 4
        return int.from_bytes(payload[at + 1 : at + 1 + width], "big")
    return 0


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
