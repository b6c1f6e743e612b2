"""Bounds on values that come from outside (store values, request bodies, files, events).

One rule for nesting depth, checked on the raw bytes before any recursive decoder (msgspec,
pydantic, json) or walker sees the value: a decoder's own recursion limit depends on how deep
the caller's stack already is, so the same value can pass in one place and raise
`RecursionError` in another. `MAX_DEPTH` is far deeper than any real card, route, request or
file, and far shallower than the interpreter's recursion limit.

Every decoder of outside JSON calls `check_json_depth` first: a store value over the bound is
skipped and counted, a client body over it is answered 400, a file over it is refused.
"""

from __future__ import annotations

import array
import heapq
import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported by those who read answers: not every user of this module)
    import aiohttp

MAX_DEPTH = 64
"""The deepest nesting of arrays and objects shoal accepts in any outside JSON value."""

# Keep only quotes and brackets, and write both kinds of bracket as `[`/`]`: depth does not
# care which kind, and a mismatched pair is the decoder's to report, as a syntax error.
_BRACKETS_ONLY = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')


class TooDeep(ValueError):
    """A JSON value nests arrays or objects deeper than allowed."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"arrays or objects are nested deeper than {limit} levels")
        self.limit = limit


def json_depth_exceeds(data: bytes | bytearray | memoryview | str, limit: int = MAX_DEPTH) -> bool:
    """Whether `data` (JSON text, valid or not) nests arrays or objects deeper than `limit`.

    Every step is one C-speed pass over bytes (no Python loop per byte): drop escapes, keep
    only quotes and brackets, drop what lies between quotes, then peel one level of innermost
    pairs per pass. A value with at most `limit` openers costs two counts, which is most
    values. When no string holds a bracket (a chat of 200,000 messages), each string is left
    as `""` and one `replace` drops them all: splitting at every quote cost ~0.8 s of event
    loop for 8 MB. (If every quote goes in adjacent pairs, no string held a bracket: the
    first that did would need an odd number of quotes before the bracket ahead of it.)
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    # Escapes go first (`\\` before `\"`), so every quote left opens or closes a string
    # and the pieces outside strings are the even ones.
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = raw.translate(_BRACKETS_ONLY, _NOT_STRUCTURE)
    brackets = structure.replace(b'""', b"")
    if b'"' in brackets:  # some string holds a bracket
        brackets = b"".join(structure.split(b'"')[::2])
    return _peel_exceeds(brackets, limit)


PEELED = 4
"""Passes that peel a level before what is left is judged by its running depth: a few passes
decide most values (each drops every innermost pair, and most values are shallow), but one
dense in deep nests needs a pass a level: 64 KiB of arrays 62 deep took 10-28 ms, where the
running depth of what is left takes ~1 ms."""
_STEPS = bytes.maketrans(b"[]", b"\x01\xff")  # as signed bytes: an opener +1, a closer -1
_LEVELS = bytes(range(256))


def _peel_exceeds(brackets: bytes, limit: int) -> bool:
    """Whether `brackets` (only `[` and `]`, every opener closed) nests deeper than `limit`."""
    for level in range(limit + 1):
        # After `level` passes each bracket left sits `level` levels above a leaf, so a run of
        # openers longer than what remains of the budget proves the value too deep.
        if b"[" * (limit - level + 1) in brackets:
            return True
        if level == PEELED and (verdict := _running_exceeds(brackets, limit - level)) is not None:
            return verdict
        brackets = brackets.replace(b"[]", b"")
        if b"[" not in brackets:
            return False  # nothing left but stray closers: malformed, for the decoder to say
    return True


def _running_exceeds(brackets: bytes, budget: int) -> bool | None:
    """Whether `brackets` nest deeper than `budget` (under 255), by their running depth in one
    C-speed pass, the verdict peeling to the end gives: an opener left open is never peeled
    (too deep). None when a closer closes nothing (malformed: left to peeling)."""
    steps = array.array("b", brackets.translate(_STEPS))
    try:
        levels = bytes(itertools.accumulate(steps))  # each 0-255, else ValueError
    except ValueError:  # a level below 0 (a stray closer) or over 255 (too deep)
        return None if min(itertools.accumulate(steps)) < 0 or budget >= 255 else True
    if levels and levels[-1]:  # openers left open
        return True
    return bool(levels.translate(None, _LEVELS[: budget + 1]))  # a level over the budget


class DepthMeter:
    """`json_depth_exceeds` of a value that arrives in pieces (a request body as the socket
    delivers it): each `feed` makes the same few C-speed passes over its piece alone, so a
    10 MB body is judged a piece at a time instead of in one hold of the event loop.

    Carried between pieces: the depth (openers not closed yet), whether a string is open,
    and a backslash whose escape goes on in the next piece. Exact for valid JSON; after the
    first syntax error it may judge less deep than the text is, which no decoder reaches
    (they stop at that error)."""

    __slots__ = ("carry", "depth", "exceeded", "fed", "in_string", "limit", "pieces_fed")

    def __init__(self, limit: int = MAX_DEPTH) -> None:
        self.limit = limit
        self.depth = 0
        self.in_string = False
        self.carry = b""
        self.exceeded = False
        self.fed = 0  # bytes
        self.pieces_fed = 0  # of the list `feed_new` is given

    def feed_new(self, pieces: list[bytes]) -> bool:
        """Add the pieces of `pieces` (a list that only grows) not added yet, in one `feed`
        (a few kB each, the steps of a `feed` cost more than its passes over the bytes)."""
        fresh = pieces[self.pieces_fed :]
        self.pieces_fed = len(pieces)
        if not fresh:
            return self.exceeded
        return self.feed(fresh[0] if len(fresh) == 1 else b"".join(fresh))

    def feed(self, piece: bytes) -> bool:
        """Add `piece`; whether what was fed so far nests deeper than `limit` (for good)."""
        self.fed += len(piece)
        if self.exceeded:
            return True
        raw = self.carry + piece if self.carry else piece
        self.carry = b""
        if raw.endswith(b"\\"):
            # A run of backslashes at the end: its pairs are escaped backslashes; an odd
            # one escapes the next piece's first byte, so it goes on with that piece.
            run = len(raw) - len(raw.rstrip(b"\\"))
            if run % 2:
                raw, self.carry = raw[:-1], b"\\"
        if b"\\" in raw:
            raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
        structure = raw.translate(_BRACKETS_ONLY, _NOT_STRUCTURE)
        if self.in_string:
            structure = b'"' + structure
        self.in_string = structure.count(b'"') % 2 == 1
        if self.in_string:  # the last quote opens a string that goes on in the next piece
            structure = structure[: structure.rindex(b'"')]
        brackets = structure.replace(b'""', b"")
        if b'"' in brackets:  # some string holds a bracket
            brackets = b"".join(structure.split(b'"')[::2])
        opens = brackets.count(b"[")
        if self.depth + opens > self.limit:
            # Closed at the end (that adds no depth), the peeling of `json_depth_exceeds`.
            left_open = max(0, self.depth + 2 * opens - len(brackets))
            closed = b"[" * self.depth + brackets + b"]" * left_open
            if _peel_exceeds(closed, self.limit):
                self.exceeded = True
                return True
        self.depth = max(0, self.depth + 2 * opens - len(brackets))
        return False


def check_json_depth(data: bytes | bytearray | memoryview | str, limit: int = MAX_DEPTH) -> None:
    """Raise `TooDeep` when `data` nests deeper than `limit` (see `json_depth_exceeds`)."""
    if json_depth_exceeds(data, limit):
        raise TooDeep(limit)


MAX_LISTED = 20
"""The refused values (store keys, routes, grants) a report names; it counts them all."""


def first_listed(skipped: Mapping[str, str], limit: int = MAX_LISTED) -> list[dict[str, str]]:
    """The first `limit` of `skipped` (key → why), by key, as `/health` lists them: a
    report stays small however many values an outside writer spoils."""
    return [{"key": k, "reason": r} for k, r in heapq.nsmallest(limit, skipped.items())]


async def read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body of `response`, or None when it is over `limit` bytes: said by its
    `Content-Length` before anything is read, else found as it is read (64 KiB at a time)."""
    if (response.content_length or 0) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(64 << 10):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
