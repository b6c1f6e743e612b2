"""Layer 2: KV cache events in vLLM's wire format, chained token-block hashing, and the
per-instance subscription to a worker's KV publisher.

Engines publish which KV blocks they store and evict (`events`; a large batch is decoded a
bounded step at a time by `sliced`, along msgpack's framing, `framing`); the frontend's indexer
hashes token blocks itself (`hashing`), so it never depends on an engine's hash function.
`subscription` (`KvSubscription`: replay on connect and on gap, resnapshot when history is
gone, publisher restarts) is the one reader of a worker's stream, shared by the frontend and
the relay (`shoal.relay`); it is the only module here that does I/O (ZMQ), and it is imported
from `shoal.kv.subscription`, not from this package, so readers of the pure data do not load it.
"""

from shoal.kv.events import (
    END_OF_REPLAY,
    WIRE_FORMATS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEndpoint,
    KvEvent,
    KVEventBatch,
    check_zmq_endpoint,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_batch_map,
    encode_seq,
    wire_hash,
)
from shoal.kv.hashing import ROOT_HASH, chain_hash, token_block_hashes

__all__ = [
    "END_OF_REPLAY",
    "ROOT_HASH",
    "WIRE_FORMATS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KvEndpoint",
    "KvEvent",
    "chain_hash",
    "check_zmq_endpoint",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_batch_map",
    "encode_seq",
    "token_block_hashes",
    "wire_hash",
]
