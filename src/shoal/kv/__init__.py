"""Layer 2: KV cache events in vLLM's wire format, and chained token-block hashing. Pure data.

Engines publish which KV blocks they store and evict (`events`); the frontend's indexer
hashes token blocks itself (`hashing`), so it never depends on an engine's hash function.
"""

from shoal.kv.events import (
    END_OF_REPLAY,
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
    encode_seq,
)
from shoal.kv.hashing import ROOT_HASH, chain_hash, token_block_hashes

__all__ = [
    "END_OF_REPLAY",
    "ROOT_HASH",
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
    "encode_seq",
    "token_block_hashes",
]
