"""Decoding KV event batches in vLLM's wire format; chained block hashing."""

from __future__ import annotations

import msgspec
import pytest

from shoal.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    chain_hash,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    token_block_hashes,
)
from tests.kv import vllm_fixtures as vllm


def test_a_vllm_batch_decodes_to_its_events_in_order() -> None:
    payload = vllm.batch(
        vllm.stored([11, 12], None, list(range(8)), 4),
        vllm.removed([11]),
        vllm.cleared(),
    )
    batch = decode_batch(payload)
    assert batch.ts == 1_700_000_000.5
    assert batch.data_parallel_rank == 0
    first, second, third = batch.events
    assert first == BlockStored(
        block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
        medium="GPU",
    )  # fmt: skip
    assert second == BlockRemoved(block_hashes=[11], medium="GPU")
    assert isinstance(third, AllBlocksCleared)


def test_older_vllm_batches_without_trailing_fields_decode() -> None:
    payload = vllm.batch(
        vllm.stored([b"\x01" * 32], b"\x00" * 32, [1, 2], 2, medium=False),
        vllm.removed([b"\x01" * 32], medium=False),
        dp_rank=None,
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [b"\x01" * 32]
    assert stored.parent_block_hash == b"\x00" * 32 and stored.medium is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [b"\x01" * 32]


def test_newer_fields_we_do_not_know_are_ignored() -> None:
    event = [*vllm.stored([1], None, [5, 6], 2), "extra-field", 42]
    batch = decode_batch(msgspec.msgpack.encode([1.0, [event], 0, "more"]))
    assert isinstance(batch.events[0], BlockStored) and batch.events[0].token_ids == [5, 6]


def test_shoal_encodes_what_vllm_would_send() -> None:
    ours = KVEventBatch(
        ts=2.0,
        events=[
            BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1, 2], block_size=2),
            BlockRemoved(block_hashes=[7]),
            AllBlocksCleared(),
        ],
    )
    # Every field is sent, as vLLM (whose fields have no defaults) sends them.
    assert msgspec.msgpack.decode(encode_batch(ours)) == [
        2.0,
        [
            ["BlockStored", [7], None, [1, 2], 2, None, None],
            ["BlockRemoved", [7], None],
            ["AllBlocksCleared"],
        ],
        None,
    ]


def test_an_unknown_event_type_is_a_decode_error_naming_it() -> None:
    with pytest.raises(msgspec.ValidationError, match="BlockMoved"):
        decode_batch(msgspec.msgpack.encode([1.0, [["BlockMoved", [1]]]]))


def test_sequence_numbers_are_8_byte_big_endian() -> None:
    assert encode_seq(258) == b"\x00" * 6 + b"\x01\x02"
    assert decode_seq(encode_seq(2**40)) == 2**40
    with pytest.raises(ValueError, match="8 bytes"):
        decode_seq(b"\x01")


def test_chained_hashes_name_prefixes() -> None:
    a = token_block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = token_block_hashes([1, 2, 3, 4, 9, 9], 2)
    assert len(a) == 3  # the partial block is not hashed
    assert a[:2] == b[:2] and a[2] != b[2]
    assert token_block_hashes([3, 4], 2) != [a[1]]  # same block, other prefix: another name
    assert a[1] == chain_hash(chain_hash(0, [1, 2]), [3, 4])
    assert token_block_hashes(list(range(100)), 2, limit=3) == token_block_hashes(list(range(6)), 2)
