"""Rate-limit windows kept in this process, and what a verdict on them answers.

`LocalWindows` applies a key's rpm and tpm alone: the fallback while Redis is down (at 1/N of
each limit) and the limits of a frontend without `--limits`; the same sliding-window estimate
as `limits.LEASE` (the previous minute weighted by the part of it still inside the last 60 s,
plus this minute's). `Refusal` and `headers_of` (OpenAI's `x-ratelimit-*` lines) are shared
with the Redis path. A key is its (workspace, name): its live secrets share its windows.

Tokens, as in Redis: each request admitted reserves its tokens (its own `estimate`, made once
when it came, or the
running average of the key's answers here when that is larger) in the tpm window, and its
end charges what its answer used beyond (or short of) that: the requests in flight count,
so a burst overshoots tpm by at most the last one admitted. A request that ends
in a later minute than it was admitted in gives its reservation back to that minute's window
(the previous minute's, or nothing once it left the sliding window) and charges its answer's
tokens to the current minute whole.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Protocol

from shoal.discovery.grants import Grant

WINDOW = 60  # seconds: limits are per minute
MAX_KEYS = 100_000  # keys' states held here (beyond, idle ones are forgotten)


MAX_DECLARED = 10  # bytes of a declared completion looked at: 9 digits, and what follows
_DECLARED = re.compile(rb"\d{1,9}(?!\d)")  # (a larger count, a sign, a string: nothing known)
MAX_CHOICES = 128  # choices a request is counted for at most (OpenAI's bound on `n`)


def fade(prev: float, cur: float, bound: float, keep: float) -> int:
    """Seconds to wait (`Retry-After`) until the sliding estimate `prev x keep + cur` is
    below `bound`, nothing more being counted: before the minute turns if this minute's own
    `cur` is under it (the previous minute's `prev` fades linearly until then), else once the
    turn made `cur` the fading previous minute. The first whole second past that time: a
    client waiting exactly this long is admitted. `LEASE`'s `wait` (`limits.py`) is the same
    in Lua."""
    if prev > 0 and cur < bound:
        at = (prev * keep + cur - bound) / prev * WINDOW
    elif cur > 0:
        at = keep * WINDOW + WINDOW * (1 - bound / cur)
    else:
        at = keep * WINDOW
    return math.floor(at) + 1


def estimate(
    size: int,
    max_completion_tokens: bytes = b"",
    max_tokens: bytes = b"",
    n: bytes = b"",
    best_of: bytes = b"",
) -> int:
    """A request's tokens before its answer (OpenAI's own estimate): its prompt as its body's
    `size` in bytes / 4, plus the completion it allows: its `max_completion_tokens`, else its
    `max_tokens`, for each choice it asks (`n`, or `best_of` if larger, at most
    `MAX_CHOICES`: engines answer them all, and OpenAI counts `n` x `max_tokens`; counted
    once, a burst asking 50 choices each was admitted at 1/50 of its size); each the JSON
    text of the request's own top-level member, decoded with its other fields
    (`proxy.fields.TokenFields`), when an integer of at most 9 digits. Made once per request,
    when it comes (the waiter keeps it); at most `MAX_DECLARED` bytes of each value are looked
    at, whatever the body holds (searching the body for every `"max_tokens"` made a 9 MB body
    quoting it 700,000 times cost ~550 ms a search)."""
    tokens = size // 4
    for declared in (max_completion_tokens, max_tokens):
        if declared and (found := _DECLARED.match(declared, 0, MAX_DECLARED)) is not None:
            return tokens + int(found.group()) * _choices(n, best_of)
    return tokens


def _choices(n: bytes, best_of: bytes) -> int:
    """The choices a request asks for: its `n`, or its `best_of` if larger (1 if neither is
    a positive integer), at most `MAX_CHOICES`."""
    choices = 1
    for asked in (n, best_of):
        if asked and (found := _DECLARED.match(asked, 0, MAX_DECLARED)) is not None:
            choices = max(choices, int(found.group()))
    return min(choices, MAX_CHOICES)


class Ticket(Protocol):
    """A request as the limits see it: the tokens reserved for it when admitted (given back,
    and its answer's charged instead, at its end), where: in Redis (`shared`), or in these
    windows, and in which `minute` (Redis' window, or `now // WINDOW` here)."""

    reserved: int
    shared: bool
    minute: int


@dataclass(slots=True)
class Refusal:
    """A request refused by rpm or tpm: its `x-ratelimit-*` header lines, and when to retry."""

    headers: bytes
    retry_after: int
    what: str  # "requests" or "tokens": the limit that refused


_REQUESTS = (
    b"x-ratelimit-limit-requests: %d\r\nx-ratelimit-remaining-requests: %d\r\n"
    b"x-ratelimit-reset-requests: %ds\r\n"
)
_TOKENS = (
    b"x-ratelimit-limit-tokens: %d\r\nx-ratelimit-remaining-tokens: %d\r\n"
    b"x-ratelimit-reset-tokens: %ds\r\n"
)
_BOTH = _REQUESTS + _TOKENS


def headers_of(
    grant: Grant,
    left_requests: float,
    left_tokens: float,
    reset: int,
    reset_tokens: int | None = None,
) -> bytes:
    """The `x-ratelimit-*` lines: `reset` the requests' (and the tokens', unless
    `reset_tokens` says otherwise: a refusal's limits each reset when they do)."""
    rpm, tpm = grant.rpm, grant.tpm
    reset_t = reset if reset_tokens is None else reset_tokens
    if rpm is not None:
        if tpm is not None:
            left_t = left_tokens if left_tokens > 0 else 0
            left_r = left_requests if left_requests > 0 else 0
            return _BOTH % (rpm, left_r, reset, tpm, left_t, reset_t)
        return _REQUESTS % (rpm, left_requests if left_requests > 0 else 0, reset)
    if tpm is not None:
        return _TOKENS % (tpm, left_tokens if left_tokens > 0 else 0, reset_t)
    return b""


class _Window:
    """One key's two fixed windows here: this minute's and the one before."""

    __slots__ = ("avg", "minute", "prev_requests", "prev_tokens", "requests", "tokens")

    def __init__(self, minute: int) -> None:
        self.minute = minute
        self.requests = self.tokens = self.prev_requests = self.prev_tokens = 0
        self.avg = 0.0  # tokens per answer here (0: none seen yet)


class LocalWindows:
    """The same sliding windows as `LEASE` (`limits.py`), in this process (the fallback, or
    no Redis), per key: by workspace, then name (the grant's own strings, no tuple made)."""

    def __init__(self) -> None:
        self._windows: dict[str, dict[str, _Window]] = {}
        self._held = 0  # windows in `_windows`
        self._swept = 0  # the minute windows were last swept (at most once a minute)

    def _at(self, grant: Grant, minute: int) -> _Window:
        named = self._windows.get(grant.workspace)
        if named is None:
            named = self._windows[grant.workspace] = {}
        window = named.get(grant.name)
        if window is None:
            if self._held >= MAX_KEYS and self._swept != minute:
                self._swept = minute  # bounded: windows of keys idle for a minute go
                self._forget(minute)
            window = named[grant.name] = _Window(minute)
            self._held += 1
        elif window.minute != minute:
            if window.minute == minute - 1:
                window.prev_requests, window.prev_tokens = window.requests, window.tokens
            else:
                window.prev_requests = window.prev_tokens = 0
            window.requests = window.tokens = 0
            window.minute = minute
        return window

    def admit(
        self,
        grant: Grant,
        share: int,
        tokens: int = 0,
        ticket: Ticket | None = None,
        now: float | None = None,
    ) -> bytes | Refusal:
        """The header lines of an admitted request, or its `Refusal`. An admitted request
        reserves its tokens (its `estimate`, `tokens`, or the key's average answer if larger:
        a key's small answers never let a request declaring more reserve less) in the tpm
        window, told to its `ticket` (its end gives them back: `charge`)."""
        now = time.time() if now is None else now
        minute = int(now // WINDOW)
        keep = 1 - (now - minute * WINDOW) / WINDOW
        turn = math.ceil(keep * WINDOW)
        window = self._at(grant, minute)
        r = window.prev_requests * keep + window.requests
        tk = window.prev_tokens * keep + window.tokens
        rpm = -(-grant.rpm // share) if grant.rpm else 0
        tpm = -(-grant.tpm // share) if grant.tpm else 0
        if rpm and r + 1 > rpm:  # (each limit's reset: its own wait, or the turn if not out)
            wait = fade(window.prev_requests, window.requests, rpm - 1, keep)
            out = tpm and tk >= tpm
            tokens = fade(window.prev_tokens, window.tokens, tpm, keep) if out else turn
            return Refusal(headers_of(grant, 0, tpm - tk, wait, tokens), wait, "requests")
        if tpm and tk >= tpm:
            wait = fade(window.prev_tokens, window.tokens, tpm, keep)
            return Refusal(headers_of(grant, rpm - r, 0, turn, wait), wait, "tokens")
        window.requests += 1
        if tpm:
            per = max(math.ceil(window.avg), tokens)  # (its own size, at least)
            window.tokens += per
            tk += per
            if ticket is not None:
                ticket.reserved, ticket.shared, ticket.minute = per, False, minute
        return headers_of(grant, rpm - r - 1, tpm - tk, turn)

    def seed(
        self,
        grant: Grant,
        share: int,
        used_requests: float,
        used_tokens: float,
        now: float | None = None,
    ) -> None:
        """Start the key's windows here at its 1/`share` of what the shared windows had used
        when last heard of (`used_*`: what Redis counted against the limits it was asked
        about then), unless more is counted here already."""
        now = time.time() if now is None else now
        window = self._at(grant, int(now // WINDOW))
        if grant.rpm:
            window.requests = max(window.requests, int(max(used_requests, 0) // share))
        if grant.tpm:
            window.tokens = max(window.tokens, int(max(used_tokens, 0) // share))

    def charge(
        self,
        grant: Grant,
        tokens: int,
        reserved: int = 0,
        now: float | None = None,
        answer: bool = True,
        minute: int | None = None,
    ) -> None:
        """An `answer`'s `tokens` charged to the key's tpm, instead of the `reserved` ones (not
        an `answer`: tokens owed to Redis, charged here while it is down). The reservation was
        made in `minute` (None: this one): given back there, the tokens charged to this one."""
        now = time.time() if now is None else now
        current = int(now // WINDOW)
        window = self._at(grant, current)
        if tokens > 0 and answer:
            window.avg = tokens if not window.avg else window.avg + (tokens - window.avg) / 8
        if reserved and minute is not None and minute != current:
            if minute == current - 1:
                window.prev_tokens = max(window.prev_tokens - reserved, 0)
            reserved = 0  # (older: it left the sliding window already)
        window.tokens = max(window.tokens + tokens - reserved, 0)

    def _forget(self, minute: int) -> None:
        for named in self._windows.values():
            for name in [n for n, w in named.items() if w.minute < minute - 1]:
                del named[name]
        self._held = sum(map(len, self._windows.values()))
