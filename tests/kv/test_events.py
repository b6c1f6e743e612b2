"""Decoding KV event batches in vLLM's wire format; chained block hashing."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from shoal.kv import (
    WIRE_FORMATS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    chain_hash,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_batch_map,
    encode_seq,
    token_block_hashes,
    wire_hash,
)
from shoal.kv import events as events_module
from shoal.worker.engines.mocker.prefix_cache import PrefixCache
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


# -- the tagged-map form (vLLM 0.28 on; vllm-router's kv_aware) ---------------------------------

# What vllm-router 0.1.17 admits (its `kv_events` decoder and dense-GPU admission): the keys
# each event type may carry, and those it must.
ROUTER_ALLOWED = {
    "BlockStored": {
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    },
    "BlockRemoved": {"type", "block_hashes", "medium", "group_idx", "locality", "ownership"},
    "AllBlocksCleared": {"type"},
}  # fmt: skip
ROUTER_REQUIRED = {
    "BlockStored": {
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name",
    },
    "BlockRemoved": {"block_hashes", "medium"},
    "AllBlocksCleared": set(),
}  # fmt: skip


def cache_events() -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """A mocker prefix cache's events over prompts that share a prefix and evict."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    cache = PrefixCache(6, 4, events.append)
    for prompt in (list(range(17)), [*range(8), *range(100, 113)], list(range(200, 216))):
        cache.admit(cache.block_hashes(prompt), prompt)
    cache.clear()
    return events


def test_the_map_form_decodes_to_the_same_blocks_as_the_array_form() -> None:
    events = cache_events()
    kinds = [type(e) for e in events]
    assert {BlockStored, BlockRemoved, AllBlocksCleared} <= set(kinds)
    batch = KVEventBatch(ts=5.25, events=events)
    as_array, as_map = decode_batch(encode_batch(batch)), decode_batch(encode_batch_map(batch))
    assert as_map.ts == as_array.ts and [type(e) for e in as_map.events] == kinds
    for a, m in zip(as_array.events, as_map.events, strict=True):
        if isinstance(a, BlockStored):
            assert isinstance(m, BlockStored)
            assert m.token_ids == a.token_ids and m.block_size == a.block_size
            assert m.block_hashes == [wire_hash(h) for h in a.block_hashes]
            parent = a.parent_block_hash
            assert m.parent_block_hash == (None if parent is None else wire_hash(parent))
            assert m.medium == "GPU"
        elif isinstance(a, BlockRemoved):
            assert isinstance(m, BlockRemoved)
            assert m.block_hashes == [wire_hash(h) for h in a.block_hashes]
    # The 32-byte names are one-to-one: distinct blocks stay distinct, negative hashes too.
    hashes = [h for e in as_array.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len({wire_hash(h) for h in hashes}) == len(set(hashes))
    assert wire_hash(-1) != wire_hash(1) and wire_hash(2**63 - 1) != wire_hash(-(2**63))


def test_the_map_form_is_what_vllm_router_admits() -> None:
    raw = msgspec.msgpack.decode(encode_batch_map(KVEventBatch(ts=1.0, events=cache_events())))
    assert isinstance(raw, list) and 2 <= len(raw) <= 3 and raw[0] == 1.0
    for event in raw[1]:
        assert isinstance(event, dict)
        kind = event["type"]
        assert ROUTER_REQUIRED[kind] <= set(event) <= ROUTER_ALLOWED[kind]
        if kind == "AllBlocksCleared":
            continue
        assert event["medium"] == "GPU"
        hashes = [*event["block_hashes"], event.get("parent_block_hash") or b"\0" * 32]
        assert hashes and all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
        if kind == "BlockStored":
            assert len(event["token_ids"]) == len(event["block_hashes"]) * event["block_size"]
            assert event["lora_id"] is None and event["lora_name"] is None


def test_a_vllm_map_batch_decodes_with_the_fields_shoal_does_not_know() -> None:
    stored = {
        "type": "BlockStored", "block_hashes": [2**64 - 1, 7], "parent_block_hash": None,
        "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
        "lora_name": None, "group_idx": 0, "extra_keys": [None, ["salt"]],
        "kv_cache_spec_kind": "full_attention",
    }  # fmt: skip
    removed = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    payload = msgspec.msgpack.encode([2.5, [stored, removed, {"type": "AllBlocksCleared"}], 0])
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 0
    assert batch.events == [
        BlockStored(
            block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=list(range(8)),
            block_size=4, medium="GPU",
        ),
        BlockRemoved(block_hashes=[7], medium="GPU"),
        AllBlocksCleared(),
    ]  # fmt: skip


def test_a_batch_in_neither_form_is_still_refused_naming_the_array_form() -> None:
    with pytest.raises(msgspec.ValidationError, match="array"):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]))
    with pytest.raises(msgspec.ValidationError):
        decode_batch(msgspec.msgpack.encode([1.0, [42], 0]))
    assert WIRE_FORMATS == ("array", "map")


@pytest.mark.parametrize("encode", [encode_batch, encode_batch_map])
def test_a_batch_of_more_events_than_the_bound_is_refused_before_it_is_decoded(
    encode: Callable[[KVEventBatch], bytes],
) -> None:
    """250,000 events of no block fit in 4 MiB and took 70-230 ms to decode, on the event
    loop: a batch is read by its header's count of events first."""
    with pytest.raises(msgspec.DecodeError, match="250000 events"):
        decode_batch(encode(KVEventBatch(1.5, [BlockRemoved([])] * 250_000)))
    bound = events_module.MAX_BATCH_EVENTS
    assert (
        len(decode_batch(encode(KVEventBatch(1.5, [AllBlocksCleared()] * bound))).events) == bound
    )
    with pytest.raises(msgspec.DecodeError, match="events, over"):
        decode_batch(encode(KVEventBatch(2**40, [AllBlocksCleared()] * (bound + 1))))
    # The batch's array in a longer form than needed says the same.
    events = msgspec.msgpack.encode([["AllBlocksCleared"]] * (bound + 1))
    with pytest.raises(msgspec.DecodeError, match="events, over"):
        decode_batch(b"\xdc\x00\x03" + msgspec.msgpack.encode(-7) + events + b"\xc0")


@pytest.mark.parametrize("encode", [encode_batch, encode_batch_map])
@pytest.mark.parametrize("where", ["stored", "parent", "removed"])
def test_an_engine_hash_over_64_bytes_makes_its_batch_unreadable(
    encode: Callable[[KVEventBatch], bytes], where: str
) -> None:
    """Hashes are the index's keys and the index is bounded in blocks: 4 KB hashes held ~1 GiB
    an instance at its cap. vLLM's are 32 bytes; 64 are read, more refused."""

    def event(block_hash: bytes) -> BlockStored | BlockRemoved:
        if where == "removed":
            return BlockRemoved([block_hash])
        if where == "parent":
            return BlockStored([1], block_hash, [1, 2], 2)
        return BlockStored([block_hash], None, [1, 2], 2)

    fits = decode_batch(encode(KVEventBatch(0.0, [event(b"h" * 64)])))
    assert len(fits.events) == 1
    with pytest.raises(msgspec.ValidationError):
        decode_batch(encode(KVEventBatch(0.0, [event(b"h" * 4096)])))
