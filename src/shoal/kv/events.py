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

Block hashes are opaque engine values (an int or bytes): only equality matters.
"""

from __future__ import annotations

import re

import msgspec

BlockHash = int | bytes
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


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack payload; `msgspec.DecodeError` (or ValidationError) if malformed.

    Depth: every field the schema knows has a fixed shape, so a nested value where one is
    expected is a `ValidationError` at once; only the trailing fields a reader ignores are
    skipped whatever they hold. Binary msgpack has no brackets for `shoal.bounds` to count,
    so a payload nested past the interpreter's recursion limit there (called from the same
    shallow frame of the subscriber every time) is answered as the `DecodeError` it is.
    """
    try:
        return _decoder.decode(payload)
    except RecursionError:
        raise msgspec.DecodeError("KV event batch: values nested too deeply") from None


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
