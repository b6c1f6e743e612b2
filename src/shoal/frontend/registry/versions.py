"""Which checksum each worker set runs: a function of the cards in discovery, not of history.

Every frontend over one store must serve the same version of a model, whatever order its
cards arrived in and however fast their metadata downloaded. So the checksum of a worker
set is elected from every card discovery holds for it (joined or not):

1. a checksum with an untainted card beats one whose cards are all tainted (a rolling
   upgrade: once every old instance drains, the waiting version takes over at once);
2. then the checksum whose oldest card (lowest store revision among its untainted cards,
   or among all of them when all are tainted) is oldest wins: the running version stays
   until it drains or leaves;
3. then the smaller checksum, so that even a tie has one answer.

Store revisions are the same for every reader, so two frontends elect the same checksum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K")
S = TypeVar("S")

_Oldest = tuple[int, str] | None  # (revision, str(key)) of the oldest card, None: recompute


@dataclass(eq=False, slots=True)
class _Version(Generic[K]):
    """The cards of one checksum in one worker set: key -> revision, and which are tainted."""

    cards: dict[K, int] = field(default_factory=dict)
    tainted: set[K] = field(default_factory=set)  # (a few at a time: those draining)
    oldest_untainted: _Oldest = None
    oldest: _Oldest = None

    @property
    def untainted(self) -> int:
        return len(self.cards) - len(self.tainted)

    def rank(self) -> tuple[bool, int, str]:
        """Lower ranks win: (all tainted, revision of the oldest card that counts, its key)."""
        if self.untainted:
            if self.oldest_untainted is None:
                self.oldest_untainted = min(
                    (rev, str(key)) for key, rev in self.cards.items() if key not in self.tainted
                )
            return (False, *self.oldest_untainted)
        if self.oldest is None:
            self.oldest = min((rev, str(key)) for key, rev in self.cards.items())
        return (True, *self.oldest)

    def put(self, key: K, revision: int, tainted: bool) -> None:
        self.drop(key)
        self.cards[key] = revision
        entry = (revision, str(key))
        # A cached minimum that is None was invalidated: it is recomputed when next needed.
        if len(self.cards) == 1:
            self.oldest = entry
        elif self.oldest is not None:
            self.oldest = min(self.oldest, entry)
        if tainted:
            self.tainted.add(key)
        elif self.untainted == 1:
            self.oldest_untainted = entry
        elif self.oldest_untainted is not None:
            self.oldest_untainted = min(self.oldest_untainted, entry)

    def drop(self, key: K) -> None:
        revision = self.cards.pop(key, None)
        if revision is None:
            return
        entry = (revision, str(key))
        if self.oldest == entry:
            self.oldest = None
        if key in self.tainted:
            self.tainted.discard(key)
        elif self.oldest_untainted == entry:
            self.oldest_untainted = None


class Versions(Generic[S, K]):
    """The cards of each worker set by checksum, and the checksum each set elects.

    A card is named by its set, checksum and key in every call (the caller holds them):
    a card that moves to another set or checksum is dropped from the old one first."""

    def __init__(self) -> None:
        self._sets: dict[S, dict[str, _Version[K]]] = {}

    def put(self, set_id: S, checksum: str, key: K, revision: int, tainted: bool) -> None:
        """Record (or update) the card at `key`."""
        versions = self._sets.setdefault(set_id, {})
        version = versions.get(checksum)
        if version is None:
            version = versions[checksum] = _Version()
        version.put(key, revision, tainted)

    def drop(self, set_id: S, checksum: str, key: K) -> None:
        """Forget the card at `key` (of `set_id` and `checksum`), if known."""
        versions = self._sets.get(set_id)
        version = None if versions is None else versions.get(checksum)
        if versions is None or version is None:
            return
        version.drop(key)
        if not version.cards:
            del versions[checksum]
            if not versions:
                del self._sets[set_id]

    def elected(self, set_id: S) -> str | None:
        """The checksum `set_id` runs; None when discovery holds no card for it."""
        versions = self._sets.get(set_id)
        if not versions:
            return None
        if len(versions) == 1:
            return next(iter(versions))
        return min(versions, key=lambda checksum: (*versions[checksum].rank(), checksum))
