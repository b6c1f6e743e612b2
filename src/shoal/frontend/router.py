"""Routing policies: which instance of a worker set takes a request.

Every policy picks from the set's precomputed `routable` tuple (joined, untainted), skips
the instances a request already failed on (`exclude`), and avoids inhibited ones (recently
failed) unless nothing else is left. Picking is O(1) for round-robin and random in the
common case, and O(instances in the set) for least-loaded and prefix.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any

from shoal.frontend.registry import WorkerSet
from shoal.frontend.upstream import Upstream

POLICIES = ("round-robin", "random", "least-loaded", "prefix", "kv")


class Router:
    """A routing policy. `needs_prompt` says whether `pick` wants the prompt's start."""

    name = ""
    needs_prompt = False
    prompt_of: Callable[[Any], str] | None = None
    """How the policy reads the prompt from the request's fields (default: the proxy's text)."""

    def pick(
        self, ws: WorkerSet, prompt: str | None = None, exclude: Collection[Upstream] = ()
    ) -> Upstream | None:
        raise NotImplementedError


def _scan(ws: WorkerSet, start: int, exclude: Collection[Upstream]) -> Upstream | None:
    """The first usable instance from `start` on, wrapping; an inhibited one only as a last resort."""
    targets = ws.routable
    n = len(targets)
    fallback: Upstream | None = None
    for i in range(n):
        target = targets[(start + i) % n]
        if exclude and target in exclude:
            continue
        if target.inhibited:
            fallback = fallback or target
            continue
        return target
    return fallback


class RoundRobin(Router):
    name = "round-robin"

    def pick(
        self, ws: WorkerSet, prompt: str | None = None, exclude: Collection[Upstream] = ()
    ) -> Upstream | None:
        ws.cursor += 1
        return _scan(ws, ws.cursor, exclude)


class Random(Router):
    name = "random"

    def pick(
        self, ws: WorkerSet, prompt: str | None = None, exclude: Collection[Upstream] = ()
    ) -> Upstream | None:
        if not ws.routable:
            return None
        return _scan(ws, random.randrange(len(ws.routable)), exclude)


def _least_loaded(ws: WorkerSet, exclude: Collection[Upstream]) -> Upstream | None:
    """Fewest requests in flight from this frontend; ties go round-robin."""
    targets = ws.routable
    n = len(targets)
    ws.cursor += 1
    best: Upstream | None = None
    fallback: Upstream | None = None
    for i in range(n):
        target = targets[(ws.cursor + i) % n]
        if exclude and target in exclude:
            continue
        if target.inhibited:
            if fallback is None or target.in_flight < fallback.in_flight:
                fallback = target
            continue
        if best is None or target.in_flight < best.in_flight:
            best = target
    return best or fallback


class LeastLoaded(Router):
    name = "least-loaded"

    def pick(
        self, ws: WorkerSet, prompt: str | None = None, exclude: Collection[Upstream] = ()
    ) -> Upstream | None:
        return _least_loaded(ws, exclude)


class PrefixIndex:
    """Recent prompt prefixes of one worker set, as chained block hashes → instance.

    An approximate radix tree: block i's key hashes blocks 0..i, so a hit on block i means
    the whole prefix up to it was routed there. Bounded, least recently used first out.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.owners: OrderedDict[int, Upstream] = OrderedDict()

    def match(self, hashes: list[int]) -> tuple[Upstream | None, int]:
        """The instance that saw the longest known prefix, and how many blocks matched."""
        owner: Upstream | None = None
        matched = 0
        for i, h in enumerate(hashes):
            found = self.owners.get(h)
            if found is None:
                break
            owner, matched = found, i + 1
        return owner, matched

    def record(self, hashes: list[int], target: Upstream) -> None:
        owners = self.owners
        for h in hashes:
            owners[h] = target
            owners.move_to_end(h)
        while len(owners) > self.capacity:
            owners.popitem(last=False)


class PrefixAware(Router):
    """Send a prompt where its longest prefix went before, unless that instance is overloaded.

    Overloaded means more than `balance_threshold` requests in flight above the least-loaded
    instance of the set; then (and for prompts with no known prefix) pick the least loaded.
    """

    name = "prefix"
    needs_prompt = True

    def __init__(
        self, *, block_chars: int = 128, max_blocks: int = 64, balance_threshold: int = 4,
        capacity: int = 100_000,
    ) -> None:  # fmt: skip
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.balance_threshold = balance_threshold
        self.capacity = capacity

    def block_hashes(self, prompt: str) -> list[int]:
        size = self.block_chars
        hashes: list[int] = []
        h = 0
        for start in range(0, min(len(prompt), size * self.max_blocks), size):
            h = hash((h, prompt[start : start + size]))
            hashes.append(h)
        return hashes

    def pick(
        self, ws: WorkerSet, prompt: str | None = None, exclude: Collection[Upstream] = ()
    ) -> Upstream | None:
        index = ws.router_state
        if not isinstance(index, PrefixIndex):
            index = ws.router_state = PrefixIndex(self.capacity)
        least = _least_loaded(ws, exclude)
        if least is None or not prompt:
            return least
        hashes = self.block_hashes(prompt)
        owner, _ = index.match(hashes)
        choice = least
        if (
            owner is not None
            and owner in ws.routable
            and owner not in exclude
            and not owner.inhibited
            and owner.in_flight - least.in_flight <= self.balance_threshold
        ):
            choice = owner
        index.record(hashes, choice)
        return choice


def make_router(policy: str) -> Router:
    routers: dict[str, type[Router]] = {
        "round-robin": RoundRobin,
        "random": Random,
        "least-loaded": LeastLoaded,
        "prefix": PrefixAware,
    }
    if policy == "kv":
        from shoal.frontend.kv_router import KvRouter  # it builds on this module's policies

        return KvRouter()
    try:
        return routers[policy]()
    except KeyError:
        raise ValueError(f"unknown router {policy!r}: use one of {', '.join(POLICIES)}") from None
