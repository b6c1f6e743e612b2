"""What the mocker says: deterministic words from a hash of the request, cut at stop strings.

The same request always gets the same answer: the text comes from a linear congruential
generator seeded with a hash of the model, the seed and the prompt.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Iterator

_WORDS = (
    "the of and to in is that it for was on are as with his they at be this from have or "
    "by one had not but what all were when we there can an your which their said if do will "
    "each about how up out them then she many some so these would other into has more her two "
    "like him see time could no make than first been its who now people my made over did down "
    "only way find use may water long little very after words called just where most know get "
    "through back much go good new write our me man too any day same right look think also "
    "around another came come work three word must because does part even place well such here "
    "take why things help put years different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read last "
    "never us left end along while might next sound below saw something thought both few those "
    "always looked show large often together asked house world going want school important until "
    "form food keep children feet land side without boy once animals life enough took sometimes "
    "four head above kind began almost live page got earth need far hand high year mother light "
    "parts country father let night following picture being study second eyes soon times story"
)
VOCAB = tuple(_WORDS.split())
"""The words the mocker speaks; each is one token of its tokenizer."""

_LCG_A = 6364136223846793005
_LCG_C = 1442695040888963407
_MASK = (1 << 64) - 1


def seed_of(*parts: object) -> int:
    """A 64-bit seed from `parts` (model, seed, prompt), stable across processes."""
    digest = hashlib.blake2b("\x1e".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def generate(seed: int, count: int) -> list[str]:
    """`count` deterministic word pieces (`"word"`, `" word"`, ...) from `seed`."""
    return list(itertools.islice(pieces_of(seed), count))


def pieces_of(seed: int) -> Iterator[str]:
    """The word pieces of `seed`, without end: `generate` takes the first few."""
    x = seed
    vocab, size = VOCAB, len(VOCAB)
    x = (x * _LCG_A + _LCG_C) & _MASK
    yield vocab[(x >> 33) % size]
    while True:
        x = (x * _LCG_A + _LCG_C) & _MASK
        yield " " + vocab[(x >> 33) % size]


def carried_count(seed: int, carried: str) -> int | None:
    """How many pieces of `seed` the text `carried` is made of (a continuation goes on after
    them), or None when it is not a prefix of `seed`'s pieces cut between two of them."""
    pos = 0
    end = len(carried)
    for count, piece in enumerate(pieces_of(seed)):
        if pos >= end:
            return count
        if not carried.startswith(piece, pos):
            return None
        pos += len(piece)
    return None  # (unreachable: the pieces never end)


def apply_stop(
    pieces: list[str], stop: list[str], *, include: bool = False
) -> tuple[list[str], bool]:
    """Cut the text at the first stop string completed; returns the pieces kept and whether
    one was.

    As an engine checks the stop strings after each token, the stop string completed by
    the earliest piece wins (the first listed on a tie), and every piece up to the one
    that completed it counts as generated: it is kept, truncated, possibly to "". The
    text ends before the stop string, or after it with `include` (vLLM's
    `include_stop_str_in_output`).
    """
    text = "".join(pieces)
    ends = list(itertools.accumulate(map(len, pieces)))
    best: tuple[int, int] | None = None  # (index of the completing piece, where the text ends)
    for s in stop:
        start = text.find(s) if s else -1
        if start < 0:
            continue
        last = bisect.bisect_left(ends, start + len(s))
        if best is None or last < best[0]:
            best = (last, start + len(s) if include else start)
    if best is None:
        return pieces, False
    last, cut = best
    starts = [0, *ends[:last]]
    kept = [piece[: max(cut - start, 0)] for piece, start in zip(pieces, starts, strict=False)]
    return kept, True
