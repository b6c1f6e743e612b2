"""Routing policies: which instance of a model takes a request.

`Router.choose` makes the whole decision for a model: a worker set weighted by its instances
that can take the request, then the policy's pick within it. Policies pick from the set's
precomputed `routable` tuple (joined, untainted), skip the instances a request already failed
on (`exclude`) and never pick an inhibited (recently failed) instance; those are the last
resort across all of the model's sets, taken only when nothing else is left. Picking is O(1)
for round-robin and random in the common case (nothing inhibited), and O(instances in the
set) for least-loaded and prefix.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import re
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from typing import Any

import msgspec

from shoal.frontend.http.upstream import Upstream
from shoal.frontend.registry.registry import Model, WorkerSet

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
        """An instance of `ws` that is neither excluded nor inhibited, or None."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """For `/health`: the policy, and what it wants an operator to know."""
        return {"policy": self.name}

    def prepare(self, prompt: str | None, models: Iterable[str]) -> asyncio.Future[None] | None:
        """Work on `prompt` that must not run on the event loop, for a request to one of
        `models`: a future the first pick waits for, or None (the default: nothing to do)."""
        return None

    def choose(
        self, model: Model, prompt: str | None = None, exclude: Collection[Upstream] = ()
    ) -> Upstream | None:
        """An instance of `model` not in `exclude`; an inhibited one only if nothing else is left."""
        sets = model.routable_sets
        if len(sets) > 1 and Upstream.any_inhibited():
            return self._choose_around_inhibited(model, prompt, exclude)
        # The common case: one set, or nothing inhibited, so the registry's set weights hold.
        ws = sets[0] if len(sets) == 1 else model.pick_set()
        if ws is None:
            return None
        target = self.pick(ws, prompt, exclude)
        if target is None and len(sets) > 1:
            for other in sets:
                if other is not ws and (target := self.pick(other, prompt, exclude)):
                    break
        return target or last_resort(sets, exclude)

    def _choose_around_inhibited(
        self, model: Model, prompt: str | None, exclude: Collection[Upstream]
    ) -> Upstream | None:
        """Weigh each set by the instances that can take the request now, then pick."""
        sets = model.routable_sets
        weights = [
            sum(1 for u in ws.routable if not u.inhibited and u not in exclude) for ws in sets
        ]
        point = random.random() * sum(weights)
        for ws, weight in zip(sets, weights, strict=True):
            if weight and point < weight and (target := self.pick(ws, prompt, exclude)):
                return target
            point -= weight
        return last_resort(sets, exclude)


def last_resort(sets: Collection[WorkerSet], exclude: Collection[Upstream]) -> Upstream | None:
    """The instance not in `exclude` whose inhibition ends first: the likeliest to be back."""
    best: Upstream | None = None
    for ws in sets:
        for target in ws.routable:
            if target not in exclude and (
                best is None or target.inhibited_until < best.inhibited_until
            ):
                best = target
    return best


def _scan(ws: WorkerSet, start: int, exclude: Collection[Upstream]) -> Upstream | None:
    """The first instance from `start` on, wrapping, that is neither excluded nor inhibited."""
    targets = ws.routable
    n = len(targets)
    for i in range(n):
        target = targets[(start + i) % n]
        if (exclude and target in exclude) or target.inhibited:
            continue
        return target
    return None


class RoundRobin(Router):
    name = "round-robin"

    def pick(
        self, ws: WorkerSet, prompt: str | None = None, exclude: Collection[Upstream] = ()
    ) -> Upstream | None:
        ws.cursor += 1
        targets = ws.routable
        if targets and not exclude and not (Upstream.inhibitions_end and Upstream.any_inhibited()):
            return targets[ws.cursor % len(targets)]  # nothing to skip: no scan
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
    for i in range(n):
        target = targets[(ws.cursor + i) % n]
        if (exclude and target in exclude) or target.inhibited:
            continue
        if best is None or target.in_flight < best.in_flight:
            best = target
    return best


class LeastLoaded(Router):
    name = "least-loaded"

    def pick(
        self, ws: WorkerSet, prompt: str | None = None, exclude: Collection[Upstream] = ()
    ) -> Upstream | None:
        return _least_loaded(ws, exclude)


class PrefixIndex:
    """Recent prompt prefixes of every worker set, as chained block hashes → instance.

    An approximate radix tree: block i's key hashes blocks 0..i, so a hit on block i means
    the whole prefix up to it was routed there. One index for the whole router, so memory
    is bounded in total however many models and sets come and go (about 140 bytes an
    entry); least recently used first out. Each set's chains start from a seed of its own,
    so sets never share entries.
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


LARGE_MESSAGE = 64 << 10  # bytes of JSON: a message longer is not decoded whole for its prefix


class _MessageHead(msgspec.Struct):
    """A chat message's role, and its content left as JSON text (`LARGE_MESSAGE`)."""

    role: Any = None
    content: msgspec.Raw = msgspec.Raw(b"null")


_decode_head = msgspec.json.Decoder(_MessageHead).decode


def prefix_message(message: Any, chars: int) -> Any:
    """A chat message as prefix-aware routing reads it, of which the content's first `chars`
    characters count: a large body's message (`msgspec.Raw`) is decoded, but of one over
    `LARGE_MESSAGE` bytes only its role and the start of a text content (decoding 10 MB of
    it held the event loop 4-11 ms). Reads as the same message decoded whole does (but for
    a message that names `role` or `content` twice: its first ones are read)."""
    if not isinstance(message, msgspec.Raw):
        return message
    if len(message) > LARGE_MESSAGE:
        # The usual shape, `{"role": "...", "content": "...`, read from its first bytes: the
        # decoder would scan the whole content (3.7 ms for 10 MB) to check the object.
        head = _USUAL_HEAD.match(message, 0, 512)  # type: ignore[call-overload]
        if head is not None and len(message) - head.end() > 12 * chars + 1:  # (cut: below)
            text = _string_start(memoryview(message)[head.end() :], chars)
            if text is not None:
                return {"role": msgspec.json.decode(head[1]), "content": text}
        try:
            read = _decode_head(message)
        except msgspec.MsgspecError:
            pass  # not an object: decoded whole, as the template will
        else:
            text = _string_start(read.content, chars)
            if text is not None:
                return {"role": read.role, "content": text}
    return msgspec.json.decode(message)


_USUAL_HEAD = re.compile(
    rb'[ \t\r\n]*\{[ \t\r\n]*"role"[ \t\r\n]*:[ \t\r\n]*("[a-z_]{1,32}")[ \t\r\n]*,[ \t\r\n]*"content"[ \t\r\n]*:[ \t\r\n]*(?=")'
)
"""A chat message's start as clients write it: a plain role, then a text content (a role
with escapes, other members first, or a content that is not text go the decoder's way)."""


def _string_start(raw: msgspec.Raw | memoryview, chars: int) -> str | None:
    """At least the first `chars` characters of the JSON string `raw`, decoded from as few
    bytes as hold them (12 per character: a surrogate pair's escapes); None if `raw` is not
    a string."""
    data = memoryview(raw)
    if not data or data[0] != ord('"'):
        return None
    end = 12 * chars + 1
    if len(data) <= end:
        return msgspec.json.decode(data, type=str)
    cut = bytes(data[:end])
    for back in range(13):  # a cut inside an escape or a character: a byte less
        try:
            return msgspec.json.decode(cut[: end - back] + b'"', type=str)
        except msgspec.DecodeError:
            continue
    return None


class PrefixAware(Router):
    """Send a prompt where its longest prefix went before, unless that instance is overloaded.

    Overloaded means more than `balance_threshold` requests in flight above the least-loaded
    instance of the set; then (and for prompts with no known prefix) pick the least loaded.
    `capacity` bounds the prefix entries kept across all sets.
    """

    name = "prefix"
    needs_prompt = True

    def __init__(
        self, *, block_chars: int = 128, max_blocks: int = 64, balance_threshold: int = 4,
        capacity: int = 500_000,
    ) -> None:  # fmt: skip
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.balance_threshold = balance_threshold
        self.index = PrefixIndex(capacity)
        self._seeds = itertools.count(1)

    def block_hashes(self, prompt: str, seed: int = 0) -> list[int]:
        size = self.block_chars
        hashes: list[int] = []
        h = seed
        for start in range(0, min(len(prompt), size * self.max_blocks), size):
            h = hash((h, prompt[start : start + size]))
            hashes.append(h)
        return hashes

    def pick(
        self, ws: WorkerSet, prompt: str | None = None, exclude: Collection[Upstream] = ()
    ) -> Upstream | None:
        least = _least_loaded(ws, exclude)
        if least is None or not prompt:
            return least
        seed = ws.router_state
        if not isinstance(seed, int):
            seed = ws.router_state = next(self._seeds)
        hashes = self.block_hashes(prompt, seed)
        owner, _ = self.index.match(hashes)
        choice = least
        if (
            owner is not None
            and owner in ws.routable
            and owner not in exclude
            and not owner.inhibited
            and owner.in_flight - least.in_flight <= self.balance_threshold
        ):
            choice = owner
        self.index.record(hashes, choice)
        return choice


def make_router(policy: str) -> Router:
    routers: dict[str, type[Router]] = {
        "round-robin": RoundRobin,
        "random": Random,
        "least-loaded": LeastLoaded,
        "prefix": PrefixAware,
    }
    # "kv" is built by the frontend (`shoal.frontend.kv.router` builds on this module)
    try:
        return routers[policy]()
    except KeyError:
        raise ValueError(f"unknown router {policy!r}: use one of {', '.join(POLICIES)}") from None
