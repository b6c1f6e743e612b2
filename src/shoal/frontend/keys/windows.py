"""Rate-limit windows kept in this process, and what a verdict on them answers.

`LocalWindows` applies a key's rpm and tpm alone: the fallback while Redis is down (at 1/N of
each limit) and the limits of a frontend without `--limits`; the same sliding-window estimate
as `limits.LEASE` (the previous minute weighted by the part of it still inside the last 60 s,
plus this minute's). `Refusal` and `headers_of` (OpenAI's `x-ratelimit-*` lines) are shared
with the Redis path. A key is its (workspace, name): its live secrets share its windows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from shoal.discovery.grants import Grant

WINDOW = 60  # seconds: limits are per minute
MAX_KEYS = 100_000  # keys' states held here (beyond, idle ones are forgotten)


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


def headers_of(grant: Grant, left_requests: float, left_tokens: float, reset: int) -> bytes:
    rpm, tpm = grant.rpm, grant.tpm
    if rpm is not None:
        if tpm is not None:
            left_t = left_tokens if left_tokens > 0 else 0
            left_r = left_requests if left_requests > 0 else 0
            return _BOTH % (rpm, left_r, reset, tpm, left_t, reset)
        return _REQUESTS % (rpm, left_requests if left_requests > 0 else 0, reset)
    if tpm is not None:
        return _TOKENS % (tpm, left_tokens if left_tokens > 0 else 0, reset)
    return b""


class _Window:
    """One key's two fixed windows here: this minute's and the one before."""

    __slots__ = ("minute", "prev_requests", "prev_tokens", "requests", "tokens")

    def __init__(self, minute: int) -> None:
        self.minute = minute
        self.requests = self.tokens = self.prev_requests = self.prev_tokens = 0


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

    def admit(self, grant: Grant, share: int, now: float | None = None) -> bytes | Refusal:
        """The header lines of an admitted request, or its `Refusal`."""
        now = time.time() if now is None else now
        minute = int(now // WINDOW)
        keep = 1 - (now - minute * WINDOW) / WINDOW
        turn = math.ceil(keep * WINDOW)
        window = self._at(grant, minute)
        r = window.prev_requests * keep + window.requests
        tk = window.prev_tokens * keep + window.tokens
        rpm = -(-grant.rpm // share) if grant.rpm else 0
        tpm = -(-grant.tpm // share) if grant.tpm else 0
        if rpm and r + 1 > rpm:
            return Refusal(headers_of(grant, 0, tpm - tk, turn), turn, "requests")
        if tpm and tk >= tpm:
            return Refusal(headers_of(grant, rpm - r, 0, turn), turn, "tokens")
        window.requests += 1
        return headers_of(grant, rpm - r - 1, tpm - tk, turn)

    def charge(self, grant: Grant, tokens: int, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._at(grant, int(now // WINDOW)).tokens += tokens

    def _forget(self, minute: int) -> None:
        for named in self._windows.values():
            for name in [n for n, w in named.items() if w.minute < minute - 1]:
                del named[name]
        self._held = sum(map(len, self._windows.values()))
