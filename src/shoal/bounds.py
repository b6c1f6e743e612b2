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

import functools
import heapq
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (imported by those who read answers: not every user of this module)
    import aiohttp

MAX_DEPTH = 64
"""The deepest nesting of arrays and objects shoal accepts in any outside JSON value."""
MAX_LIMIT = 255
"""The deepest bound the check takes: its pattern (`_within`) is compiled a level inside
the other, two frames of the interpreter's stack a level."""

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

    No Python loop per byte: drop escapes, keep only quotes and brackets, drop empty strings
    (most strings: a chat of 200,000 messages), each a C-speed pass over bytes; then one
    match of what is left (`_nests_deeper`). A value with at most `limit` openers costs
    two counts, which is most values.
    """
    _check_limit(limit)
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    # Escapes go first (`\\` before `\"`), so every quote left opens or closes a string.
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    # (Two quotes in a row end a string and start one, or make an empty one: dropping
    # them drops nothing from any string, and pairs every other quote as before.)
    structure = raw.translate(_BRACKETS_ONLY, _NOT_STRUCTURE).replace(b'""', b"")
    if structure.count(b'"') % 2:
        structure += b'"'  # a string never closed: it holds the rest of the text
    return _nests_deeper(structure, limit)


@functools.lru_cache(maxsize=8)
def _within(limit: int) -> re.Pattern[bytes]:
    """Quotes and brackets (`[`/`]` only) nested at most `limit` deep, one level inside the
    other: at each, strings (`"..."`: the brackets in them count for nothing) and pairs of
    brackets around the next level; at the outermost, closers that close nothing too
    (skipped). Every repeat is possessive (`*+`): the engine never goes back, so a match is
    one pass. (1 MiB of arrays 60 deep: ~6 ms of a check of ~8 ms; peeled a level a pass,
    the check took ~35 ms, and ~150 ms after a stray closer.)"""
    string = rb'"[^"]*+"'
    level = rb"(?:" + string + rb")*+"  # the deepest: strings only
    for _ in range(limit - 1):
        level = rb"(?:\[" + level + rb"\]|" + string + rb")*+"
    if limit == 0:
        return re.compile(rb"(?:" + string + rb"|\])*+")
    return re.compile(rb"(?:\[" + level + rb"\]|" + string + rb"|\])*+")


def _check_limit(limit: int) -> None:
    if limit > MAX_LIMIT:
        raise ValueError(f"a depth bound of {limit}: the check takes one of at most {MAX_LIMIT}")


def _nests_deeper(structure: bytes, limit: int) -> bool:
    """Whether `structure` (quotes, each paired with the next, and `[`/`]` only) nests
    deeper than `limit`, in one C-speed pass: where `_within` stops short of the end, an
    opener goes one level too deep or is never closed (both too deep, as for a decoder
    that reads on)."""
    return limit < 0 or _within(limit).fullmatch(structure) is None


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
        _check_limit(limit)
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
            # Closed at the end (that adds no depth), the match of `json_depth_exceeds`.
            left_open = max(0, self.depth + 2 * opens - len(brackets))
            closed = b"[" * self.depth + brackets + b"]" * left_open
            if _nests_deeper(closed, self.limit):
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
    report stays small however many values an outside writer spoils, and however long their
    keys (etcd takes keys of 1.5 MiB: each shown cut to `MAX_SHOWN_KEY` characters)."""
    return [{"key": _cut_key(k), "reason": r} for k, r in heapq.nsmallest(limit, skipped.items())]


MAX_SHOWN_KEY = 256


def _cut_key(key: str) -> str:
    if len(key) <= MAX_SHOWN_KEY:
        return key
    return f"{key[:MAX_SHOWN_KEY]}... ({len(key):,} characters)"


def cut_for_reading(value: Any, items: int, chars: int) -> Any:
    """`value` (decoded JSON) as a report shows it: each string cut to `chars` characters
    (the last one `…`), each list to its first `items`, at every level; beside a list that
    was cut, a dict gets `{name}_total` counting it (unless it says so itself). What a
    report holds of outside values is then bounded in bytes, however long they are."""
    if isinstance(value, str):
        return value if len(value) <= chars else value[: chars - 1] + "…"
    if isinstance(value, list):
        return [cut_for_reading(item, items, chars) for item in value[:items]]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for name, item in value.items():
            out[name] = cut_for_reading(item, items, chars)
            if isinstance(item, list) and len(item) > items:
                out.setdefault(f"{name}_total", len(item))
        return out
    return value


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
