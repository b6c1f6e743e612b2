"""`KvIndex`: stored, removed, cleared and purged blocks, and prefix overlaps."""

from __future__ import annotations

from shoal.frontend.kv.index import KvIndex
from shoal.kv import AllBlocksCleared, BlockRemoved, BlockStored, token_block_hashes

BS = 2
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS
    )


def test_stored_blocks_are_found_by_the_prompts_own_hashes() -> None:
    index = KvIndex(BS)
    index.apply(1, stored([101, 102], None, PROMPT[:4]))
    index.apply(1, stored([103], 102, PROMPT[4:6]))  # chained by the engine's parent hash
    index.apply(2, stored([201], None, PROMPT[:2]))
    assert index.overlaps(token_block_hashes(PROMPT, BS)) == {1: 3, 2: 1}
    assert index.overlaps(token_block_hashes([9, 9, *PROMPT], BS)) == {}
    assert len(index) == 4


def test_removed_blocks_end_the_prefix_there() -> None:
    index = KvIndex(BS)
    index.apply(1, stored([101, 102, 103], None, PROMPT[:6]))
    index.apply(1, BlockRemoved(block_hashes=[102]))
    assert index.overlaps(token_block_hashes(PROMPT, BS)) == {1: 1}
    index.apply(1, BlockRemoved(block_hashes=[999]))  # unknown: nothing happens
    assert index.instance_blocks(1) == 2


def test_clearing_drops_only_that_instances_blocks() -> None:
    index = KvIndex(BS)
    index.apply(1, stored([101, 102], None, PROMPT[:4]))
    index.apply(2, stored([201, 202], None, PROMPT[:4]))
    index.apply(1, AllBlocksCleared())
    assert index.overlaps(token_block_hashes(PROMPT, BS)) == {2: 2}
    assert index.instance_blocks(1) == 0


def test_a_purged_instance_leaves_no_trace() -> None:
    index = KvIndex(BS)
    index.apply(1, stored([101, 102], None, PROMPT[:4]))
    index.apply(2, stored([201], None, PROMPT[:2]))
    index.purge(1)
    index.purge(2)
    assert index.holders == {} and len(index) == 0


def test_a_block_whose_parent_is_unknown_is_not_guessed() -> None:
    index = KvIndex(BS)
    index.apply(1, stored([103], 102, PROMPT[4:6]))
    assert index.overlaps(token_block_hashes(PROMPT, BS)) == {}
    assert index.orphan_blocks == 1 and index.holders == {}


def test_events_of_another_block_size_are_refused_not_misread() -> None:
    index = KvIndex(4)
    index.apply(1, stored([101], None, PROMPT[:2]))
    assert index.mismatched_events == 1 and index.holders == {}


def test_a_recent_pick_counts_until_an_eviction_cancels_it() -> None:
    index = KvIndex(BS)
    hashes = token_block_hashes(PROMPT, BS)
    index.recent.record(hashes, 1, now=100.0)
    assert index.recent.matched(hashes, now=101.0) == (1, 4)  # sent there: predicted cached
    assert index.recent.matched(hashes, now=103.0) == (0, 0)  # events never came: expired
    index.apply(1, stored([101, 102], None, PROMPT[:4]))
    index.recent.record(hashes, 1, now=200.0)
    index.apply(1, BlockRemoved(block_hashes=[102]))
    assert index.recent.matched(hashes, now=200.5) == (1, 1)  # block 1 evicted: cut there
