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

import re
from typing import Annotated

import msgspec

from shoal.kv import framing

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


def untagged(
    event: TaggedBlockStored | TaggedBlockRemoved | TaggedAllBlocksCleared,
) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """`event` read in the tagged-map form, as the array form's event."""
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
            tagged.ts, [untagged(e) for e in tagged.events], tagged.data_parallel_rank
        )
    except RecursionError:
        raise msgspec.DecodeError("KV event batch: values nested too deeply") from None


# msgpack: the bytes a number takes after its type byte (the types a float field accepts).
_NUMBER_SIZE = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2}
_NUMBER_SIZE |= {0xD2: 4, 0xD3: 8}


def declared_events(payload: bytes) -> int:
    """How many events batch `payload` says it holds (the length of its events array, read
    from the header, before anything is decoded); 0 when the header is not a batch's (the
    decoder refuses it)."""
    head = batch_head(payload)
    return 0 if head is None else head[0]


def batch_head(payload: bytes) -> tuple[int, int, int] | None:
    """(events, where their array starts, where the first one starts) of batch `payload`, read
    from its header; None when the header is not a batch's."""
    data = memoryview(payload)
    batch = framing.container(data, 0)  # the batch: an array, of its length's every form
    if batch is None or batch[0]:
        return None
    at = batch[2]
    ts = payload[at : at + 1]  # ts: a number
    if not ts:
        return None
    if ts[0] < 0x80 or ts[0] >= 0xE0:  # (a fixint: the type byte is the number)
        at += 1
    elif ts[0] in _NUMBER_SIZE:
        at += 1 + _NUMBER_SIZE[ts[0]]
    else:
        return None
    events = framing.container(data, at)  # events: an array
    if events is None or events[0]:
        return None
    return events[1], at, events[2]


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
