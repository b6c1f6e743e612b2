"""`KvIndex`: stored, removed, cleared and purged blocks, and prefix overlaps."""

from __future__ import annotations

import random
import tracemalloc

from shoal.frontend.kv.index import MAX_INSTANCE_BLOCKS, PURGE_SLICE, KvIndex
from shoal.kv import AllBlocksCleared, BlockRemoved, BlockStored, token_block_hashes
from tests.helpers import LoopTurns, wait_for

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


def chain(instance: int, blocks: int, first_token: int = 0) -> BlockStored:
    """One event storing `blocks` chained blocks (engine hashes `instance * 10**7 + i`)."""
    tokens = list(range(first_token, first_token + blocks * BS))
    return stored([instance * 10**7 + i for i in range(blocks)], None, tokens)


async def test_purging_an_instance_at_the_block_cap_releases_a_slice_per_turn_of_the_loop() -> None:
    """An instance at `MAX_INSTANCE_BLOCKS` released in one go held the loop ~120 ms (it
    leaves, clears its cache, or its stream lost records). Its blocks now leave a slice per
    turn, and count for nothing from the purge on."""
    index = KvIndex(BS)
    index.apply(1, chain(1, MAX_INSTANCE_BLOCKS))
    index.apply(2, chain(2, 4))
    prompt = list(range(8))
    assert index.overlaps(token_block_hashes(prompt, BS)) == {1: 4, 2: 4}
    turns = LoopTurns().wrap(index, "_release")  # blocks released, per turn of the loop
    index.purge(1)
    assert index.overlaps(token_block_hashes(prompt, BS)) == {2: 4}  # at once
    assert index.instance_blocks(1) == 0
    await wait_for(lambda: len(index.holders) == 4, 10)  # (a cheap check: it runs on the loop)
    await turns.stop()
    most = turns.most_per_turn
    assert all(holding == {2} for holding in index.holders.values())
    assert index.overlaps(token_block_hashes(prompt, BS)) == {2: 4}
    assert turns.on_loop == MAX_INSTANCE_BLOCKS
    assert most <= PURGE_SLICE, f"{most} blocks released in one turn of the loop"


async def test_blocks_stored_again_while_a_purge_runs_are_kept_and_counted_once_it_ends() -> None:
    index = KvIndex(BS)
    index.apply(1, chain(1, 3 * PURGE_SLICE))
    index.purge(1)  # (cleared its cache: its next blocks come)
    index.apply(1, chain(1, 4))  # the same first blocks, stored again
    index.apply(1, stored([555], None, [90, 91]))
    index.apply(1, BlockRemoved(block_hashes=[555]))  # stored and evicted while dying
    await wait_for(lambda: not index._dying, 10)
    assert index.overlaps(token_block_hashes(list(range(8)), BS)) == {1: 4}
    assert index.overlaps(token_block_hashes([90, 91], BS)) == {}
    assert len(index.holders) == 4 and index.instance_blocks(1) == 4
    index.purge(1)
    assert not index.holders


async def test_many_instances_purged_at_once_are_released_a_slice_per_turn() -> None:
    """A lost stream purges every instance of the set in one go: 100 instances of 2,000
    blocks, each under a slice, held the loop ~80 ms together. Past a slice in one turn,
    the rest is released over the next turns."""
    index = KvIndex(BS)
    for instance in range(1, 101):
        index.apply(instance, chain(instance, 2000))
    prompt = list(range(8))
    turns = LoopTurns().wrap(index, "_release")  # blocks released, per turn of the loop
    for instance in range(1, 101):
        index.purge(instance)
    assert index.overlaps(token_block_hashes(prompt, BS)) == {}  # at once
    await wait_for(lambda: not index.holders, 10)
    await turns.stop()
    most = turns.most_per_turn
    assert turns.on_loop == 100 * 2000
    assert most <= PURGE_SLICE, f"{most} blocks released in one turn of the loop"


def naive_overlaps(index: KvIndex, hashes: list[int]) -> dict[int, int]:
    """Each instance holding the first block: how many leading blocks it holds (no shortcut)."""
    first = index.holders.get(hashes[0], set()) if hashes else set()
    depths = {}
    for instance_id in first:
        depth = 0
        while depth < len(hashes) and instance_id in index.holders.get(hashes[depth], ()):
            depth += 1
        depths[instance_id] = depth
    return depths


def test_a_prefix_every_instance_holds_costs_the_instances_once_a_pick_not_once_a_block() -> None:
    """`overlaps` ran a full subset test of the instances still in against each block's
    holders: a 1,024-block prefix held by 2,500 instances cost 25 ms a pick, on the event
    loop. Each block's step (who drops out there) is now kept while nothing it depends on
    changes: after the first pick, a pick looks up no instance in a subset test (only its
    first block's holders are copied); after a change, one pick pays for the blocks after
    it. So also when the instances drop out one a block."""
    instances, blocks = 300, 256
    index = KvIndex(BS)
    for instance_id in range(1, instances + 1):
        index.apply(instance_id, chain(instance_id, blocks))
    prompt = token_block_hashes(list(range(blocks * BS)), BS)
    everyone = dict.fromkeys(range(1, instances + 1), blocks)
    assert index.overlaps(prompt) == everyone
    assert index.compared <= instances * blocks  # (the first pick: new sets)
    before = index.compared
    for _ in range(10):
        assert index.overlaps(prompt) == everyone
    assert index.compared == before  # ten picks, no instance looked up
    index.apply(7, BlockRemoved(block_hashes=[7 * 10**7 + 100]))  # evicted in the middle
    assert index.overlaps(prompt) == {**everyone, 7: 100}
    before = index.compared
    for _ in range(10):
        assert index.overlaps(prompt) == {**everyone, 7: 100}
    assert index.compared == before
    stairs = KvIndex(BS)  # instance i holds the first i blocks: one drops out at each block
    for instance_id in range(1, blocks + 1):
        stairs.apply(instance_id, chain(instance_id, instance_id))
    expected = {i: i for i in range(1, blocks + 1)}
    assert stairs.overlaps(prompt) == expected
    before = stairs.compared
    for _ in range(10):
        assert stairs.overlaps(prompt) == expected
    assert stairs.compared == before


def test_overlaps_stay_exact_as_holders_change_between_picks() -> None:
    """The subset tests kept are forgotten when a set changes: every pick equals a walk
    without shortcuts, through stores, evictions and purges between picks."""
    rng = random.Random(7)
    index = KvIndex(BS)
    prompts = [token_block_hashes(list(range(n * BS)), BS) for n in (8, 16, 32)]
    prompts.append(token_block_hashes([99, 98, *range(30)], BS))
    for step in range(600):
        instance_id = rng.randint(1, 12)
        action = rng.random()
        if action < 0.45:
            first = rng.choice([0, 99])
            tokens = [99, 98, *range(30)] if first == 99 else list(range(32))
            n = rng.randint(1, 16)
            base = instance_id * 10**7 + (first * 1000)
            index.apply(instance_id, stored([base + i for i in range(n)], None, tokens[: n * BS]))
        elif action < 0.9:
            victim = instance_id * 10**7 + rng.choice([0, 99_000]) + rng.randint(0, 15)
            index.apply(instance_id, BlockRemoved(block_hashes=[victim]))
        else:
            index.purge(instance_id)
        for prompt in prompts:
            assert index.overlaps(prompt) == naive_overlaps(index, prompt), step


def test_a_pick_recorded_at_capacity_costs_its_own_blocks_never_a_pass_over_all() -> None:
    """`RecentPicks` past its capacity made a list of every pick kept and a new dict of half
    of them, in the pick's turn of the event loop: with 1,024-block prompts, every 32nd pick
    held the loop 15-29 ms (65,536 picks copied; seen under a load of long prompts with the
    stall probe; 37 ms at most of 2,000 such picks, 59 over 5 ms). Picks are now kept in two
    generations of half the capacity, the older let go when the new one is full: a pick
    allocates its own entries (and the new generation's table as it grows), never a copy of
    all, and the latest picks are the ones kept."""
    recent = KvIndex(BS).recent
    blocks = 1024
    rounds = 4 * recent.capacity // blocks
    most = 0
    tracemalloc.start()
    try:
        for i in range(rounds):
            hashes = list(range(i * blocks, (i + 1) * blocks))
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            recent.record(hashes, 1 + i % 3, now=100.0 + i * 0.001)
            most = max(most, tracemalloc.get_traced_memory()[1] - before)
            del hashes
    finally:
        tracemalloc.stop()
    # (a copy of every pick: 6.4 MB; the new generation's table at its last growth: 1.3 MB)
    assert most < 2 << 20, f"a pick allocated {most} bytes"
    assert len(recent) <= recent.capacity
    last = list(range((rounds - 1) * blocks, rounds * blocks))
    assert recent.matched(last, now=100.0 + rounds * 0.001) == (1 + (rounds - 1) % 3, blocks)
    assert recent.matched(list(range(blocks)), now=100.0) == (0, 0)  # the oldest left
    later = 200.0  # a quiet spell: every pick kept expired
    for i in range(8):
        recent.record([10**9 + i], 1, now=later + i)
    assert recent.matched([10**9 + 7], now=later + 7) == (1, 1)
    assert len(recent) <= recent.capacity
