"""`PromptChain`: the token ids and block hashes of rendered chats, by the segments seen before.

A chat grows turn by turn: each request's rendered prompt repeats the previous one's text and
adds a little. The tokenizer matches its special tokens before anything else, so the text
between two of them is tokenized on its own, whatever surrounds it; a rendered prompt is
therefore cut into segments, each a piece of plain text and the special token that ends it,
and the ids of the whole prompt are the ids of its segments, one after the other.

Each segment is kept, keyed by (the segment before it, its text), with its ids and, per block
size, the block hashes completed in it and the ids left over for the next block: a prompt
walks its segments from the first, finds the ones seen before by one dictionary lookup each,
and tokenizes and hashes only the rest. The key holds the whole text of the segment and the
identity of the path before it, so a hit is the same text after the same text: the ids and
hashes are those of tokenizing the whole prompt. `special_split` makes the pattern that cuts
at a tokenizer's special tokens, and `splits_cleanly` checks (when a tokenizer is loaded) that
it tokenizes the text between them alone as within the whole: `PromptTokenizer` uses no chain
otherwise.

Bounded in bytes (the texts, ids and hashes kept, with their containers), least recently
used out; a segment larger than an eighth of the capacity is used once and not kept.
"""

from __future__ import annotations

import itertools
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator

from tokenizers import Tokenizer

from shoal.kv import ROOT_HASH

CHARS_PER_TOKEN = 8  # the first cut of a long piece: text for this many characters per token
CUT_MARGIN = 128  # tokens past those wanted, so the cut cannot change the ones kept
ENTRY_BYTES = 240  # an entry's own objects: the key tuple, the entry, the dictionary slot
INT_BYTES = 40  # a hash or id kept as a Python int in a tuple: the pointer and the int
MAX_FIRST_CHARS = 4  # more distinct first characters of special tokens: scan with the regex


class Deferred(Exception):
    """Work too large for the event loop, left to the tokenizer's thread."""


class _Segment:
    """One segment after one path: its ids, and per block size the hashing state after it."""

    __slots__ = ("cost", "id", "ids", "key", "states", "total")

    def __init__(self, key: tuple[int, str], ident: int, ids: array[int], total: int) -> None:
        self.key = key
        self.id = ident
        self.ids = ids
        self.total = total  # ids from the start of the prompt to the end of this segment
        # block size -> (hashes of the blocks completed in this segment, the chain's last
        # hash, the ids after the last full block)
        self.states: dict[int, tuple[tuple[int, ...], int, tuple[int, ...]]] = {}
        self.cost = sys.getsizeof(key[1]) + ids.itemsize * len(ids) + ENTRY_BYTES


class PromptChain:
    """Segments of rendered prompts, with their ids and block hashes (see the module)."""

    def __init__(
        self,
        capacity: int,
        split: re.Pattern[str],
        special_ids: dict[str, int],
        encode: Callable[[str], list[int]],
        encode_many: Callable[[list[str]], list[list[int]]],
    ) -> None:
        self.capacity = capacity
        self.bytes = 0
        self._split = split
        self._special_ids = special_ids
        self._encode = encode
        self._encode_many = encode_many
        firsts = {token[0] for token in special_ids}
        self._firsts = sorted(firsts) if len(firsts) <= MAX_FIRST_CHARS else None
        self._segments: OrderedDict[tuple[int, str], _Segment] = OrderedDict()
        self._ids = itertools.count(1)  # 0 is the start of every prompt
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._segments)

    def tokens(self, text: str, wanted: int | None = None) -> list[int]:
        """The ids of `text` (the first `wanted` of them, and then some, when given)."""
        path, rest = self._path(text, wanted)
        ids: list[int] = []
        for segment in path:
            ids.extend(segment.ids)
        ids.extend(rest)
        return ids

    def hashes(
        self, text: str, block_size: int, max_blocks: int, budget: int | None = None
    ) -> list[int]:
        """The chained hashes (`shoal.kv.token_block_hashes`) of the first `max_blocks` full
        blocks of `text`'s ids. With a `budget` (on the event loop): `Deferred` rather than
        tokenize more than `budget` characters of new text, or wait for another thread."""
        path, rest = self._path(text, max_blocks * block_size, budget)
        out: list[int] = []
        last = ROOT_HASH
        tail: tuple[int, ...] = ()
        for segment in path:
            state = segment.states.get(block_size)
            if state is None:
                state = _hash_blocks(last, tail, segment.ids, block_size)
                self._add_state(segment, block_size, state, wait=budget is None)
            out.extend(state[0])
            last, tail = state[1], state[2]
            if len(out) >= max_blocks:
                return out[:max_blocks]
        if rest:
            out.extend(_hash_blocks(last, tail, rest, block_size)[0])
        return out[:max_blocks]

    # -- the walk -----------------------------------------------------------------------------

    def _path(
        self, text: str, wanted: int | None, budget: int | None = None
    ) -> tuple[list[_Segment], list[int]]:
        """The segments of `text` from its start (kept or made), until `wanted` ids are
        covered; and the ids of a piece cut short (not kept), if one was. `Deferred` past
        `budget` characters of new text, or if another thread holds the segments."""
        path: list[_Segment] = []
        parent, total = 0, 0
        if not self._lock.acquire(blocking=budget is None):
            raise Deferred
        try:
            segments = self._segments
            cuts = self._cuts(text)
            for cut in cuts:
                if wanted is not None and total >= wanted:
                    break
                key = (parent, text[cut[0] : cut[2]])
                segment = segments.get(key)
                if segment is None:
                    return self._make(text, [cut, *cuts], path, wanted, budget)
                segments.move_to_end(key)
                path.append(segment)
                parent, total = segment.id, segment.total
        finally:
            self._lock.release()
        return path, []

    def _make(
        self,
        text: str,
        cuts: list[tuple[int, int, int, int | None]],
        path: list[_Segment],
        wanted: int | None,
        budget: int | None,
    ) -> tuple[list[_Segment], list[int]]:
        """Tokenize the segments `cuts` of `text`, all new (the one before them is), after
        `path`, and keep them: in one call when short enough to need no cut, else one by
        one, the last one cut (and not kept) once `wanted` ids are covered."""
        parent, total = (path[-1].id, path[-1].total) if path else (0, 0)
        chars = sum(cut[1] - cut[0] for cut in cuts)
        if budget is not None and chars > budget:
            raise Deferred
        batch = wanted is None or chars <= (wanted - total) * CHARS_PER_TOKEN
        if batch:
            encoded = self._encode_many([text[cut[0] : cut[1]] for cut in cuts])
        kept = all(self._segments.get(s.key) is s for s in path[-1:])
        for i, (start, piece_end, end, special) in enumerate(cuts):
            if batch:
                ids = encoded[i]
            else:
                assert wanted is not None
                if total >= wanted:
                    break
                ids, whole = self._encode_piece(text[start:piece_end], wanted + CUT_MARGIN - total)
                if not whole:
                    return path, ids
            if special is not None:
                ids.append(special)
            segment = _Segment(
                (parent, text[start:end]), next(self._ids), array("I", ids), total + len(ids)
            )
            # A segment after one that is not kept would never be found again: not kept.
            kept = kept and self._keep(segment)
            path.append(segment)
            parent, total = segment.id, segment.total
        return path, []

    def _cuts(self, text: str) -> Iterator[tuple[int, int, int, int | None]]:
        """(start, end of its plain text, end, the special token's id or None) of each
        segment of `text`; the last one may end without a special token."""
        pos = 0
        for match_start, match_end in self._specials(text):
            yield pos, match_start, match_end, self._special_ids[text[match_start:match_end]]
            pos = match_end
        if pos < len(text):
            yield pos, len(text), len(text), None

    def _specials(self, text: str) -> Iterator[tuple[int, int]]:
        """Where the special tokens are in `text`, left to right, as the split pattern finds
        them; by `str.find` of their first characters when they have few (a scan in C),
        else by the pattern."""
        pattern = self._split
        if self._firsts is None:
            for found in pattern.finditer(text):
                yield found.start(), found.end()
            return
        nexts = {c: text.find(c) for c in self._firsts}
        while True:
            at = min((i for i in nexts.values() if i >= 0), default=-1)
            if at < 0:
                return
            match = pattern.match(text, at)
            pos = at + 1
            if match is not None:
                yield at, match.end()
                pos = match.end()
            for c, i in nexts.items():
                if 0 <= i < pos:
                    nexts[c] = text.find(c, pos)

    def _encode_piece(self, piece: str, need: int | None) -> tuple[list[int], bool]:
        """The ids of `piece`, or of a cut of it holding at least `need` of them (then the
        ids past `need` near the cut may differ: dropped); and whether it was whole."""
        if need is None:
            return self._encode(piece), True
        cut = max(need, 1) * CHARS_PER_TOKEN
        while True:
            if cut >= len(piece):
                return self._encode(piece), True
            ids = self._encode(piece[:cut])
            if len(ids) >= need:
                return ids[: max(need - CUT_MARGIN, 0)], False
            cut *= 2  # tokens longer than CHARS_PER_TOKEN on average: cut further out

    # -- bounds ---------------------------------------------------------------------------------

    def _keep(self, segment: _Segment) -> bool:
        """Keep `segment`, unless it is too large (it would push out most others)."""
        if segment.cost > self.capacity // 8:
            return False
        self._segments[segment.key] = segment
        self.bytes += segment.cost
        self._evict()
        return True

    def _add_state(
        self,
        segment: _Segment,
        size: int,
        state: tuple[tuple[int, ...], int, tuple[int, ...]],
        *,
        wait: bool = True,
    ) -> None:
        """Keep `state` with `segment` (not when another thread holds the lock and `wait` is
        false: it is computed again next time)."""
        if not self._lock.acquire(blocking=wait):
            return
        try:
            if self._segments.get(segment.key) is not segment or size in segment.states:
                return  # not kept (too large, or evicted since): nothing to account
            segment.states[size] = state
            cost = INT_BYTES * (len(state[0]) + len(state[2]) + 1) + 120
            segment.cost += cost
            self.bytes += cost
            self._evict()
        finally:
            self._lock.release()

    def _evict(self) -> None:
        segments = self._segments
        while self.bytes > self.capacity and segments:
            _, oldest = segments.popitem(last=False)
            self.bytes -= oldest.cost


def _hash_blocks(
    last: int, tail: tuple[int, ...], ids: array[int] | list[int], size: int
) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """Hash the full blocks of `tail` + `ids` after the block hashed `last`: their hashes,
    the last one, and the ids left over."""
    buf = (*tail, *ids)
    full = len(buf) - len(buf) % size
    hashes = []
    for i in range(0, full, size):
        last = hash((last, *buf[i : i + size]))
        hashes.append(last)
    return tuple(hashes), last, buf[full:]


def special_split(tokenizer: Tokenizer) -> tuple[re.Pattern[str] | None, dict[str, int]]:
    """A pattern splitting text at the special tokens, and their ids; no pattern when some
    added token is matched in a way a plain split would not reproduce (stripping, word
    boundaries, normalized matching)."""
    specials: dict[str, int] = {}
    for token_id, token in tokenizer.get_added_tokens_decoder().items():
        if token.lstrip or token.rstrip or token.single_word or token.normalized:
            return None, {}
        specials[token.content] = token_id
    if not specials:
        return None, {}
    longest_first = sorted(specials, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, longest_first)) + ")"), specials


def splits_cleanly(tokenizer: Tokenizer, special_ids: dict[str, int]) -> bool:
    """Whether `tokenizer` gives a text the ids of its pieces between special tokens, each
    tokenized alone (what `PromptChain` relies on): tried on a few texts of its own words.
    Not so for, e.g., a pre-tokenizer that marks only the start of the whole text."""
    a, b, c = _words(tokenizer, set(special_ids.values()))
    for special in sorted(special_ids)[:3]:
        for text in (
            f"{a}{special}{b}",
            f"{a} {b}{special}\n {c} {special}  {a}",
            f"{special}\n\n{b}.\n{special}{c}",
        ):
            expected: list[int] = []
            for i, piece in enumerate(text.split(special)):
                if i:
                    expected.append(special_ids[special])
                if piece:
                    expected += tokenizer.encode(piece, add_special_tokens=False).ids
            if tokenizer.encode(text, add_special_tokens=False).ids != expected:
                return False
    return True


def _words(tokenizer: Tokenizer, special: set[int]) -> tuple[str, str, str]:
    """Three words of the tokenizer's vocabulary (so no probe is only unknown tokens)."""
    words: list[str] = []
    for token_id in sorted(tokenizer.get_vocab().values()):
        if token_id not in special:
            word = tokenizer.decode([token_id]).strip()
            if len(word) >= 2 and word.isalpha() and word not in words:
                words.append(word)
                if len(words) == 3:
                    return words[0], words[1], words[2]
    return "Hello", "there", "world"
