"""Rate limits of API keys: rpm and tpm shared by every frontend in Redis, max_parallel here.

`Limits.admit(grant)` decides one request in one Redis round trip (`ADMIT`, a Lua script):
each key has a sliding window per minute, estimated from two fixed windows (the previous
minute's count weighted by the part of it still inside the last 60 s, plus this minute's),
read and counted atomically on Redis' own clock, so frontends agree whatever their clocks.
Tokens are charged after the fact (`charge`, one `INCRBY` once the response's usage is
known): a request is admitted while the key's token estimate is under `tpm`, so the last one
admitted may overshoot by its own size.

Redis down (`--limits redis://...` refused, timed out): the frontend fails **open** onto
local windows at 1/N of each limit, N being the frontends that reported to Redis in its last
`FRONTENDS_TTL` seconds before the outage (each frontend adds itself to a sorted set every
`BEAT` seconds; frontends do not register in discovery). A beat that reaches Redis again
puts the shared windows back in force. `/health` says which are in force (`describe`).
Without `--limits`, every frontend applies the limits alone, as if N were 1.

`max_parallel` is counted here, per frontend, at ceil(max_parallel / N): a count in Redis
would need a lease per request to survive a frontend that dies mid-request, and a round trip
at the end of every request; per frontend it costs nothing and cannot leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from shoal.discovery.grants import Grant
from shoal.openai import ApiError

log = logging.getLogger(__name__)

WINDOW = 60  # seconds: limits are per minute
BEAT = 1.0  # seconds between two reports of this frontend to Redis (and probes when down)
FRONTENDS_TTL = 10.0  # a frontend not heard of for this long is not counted in N
TIMEOUT = 0.5  # seconds for a Redis call before it counts as down

ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local W = tonumber(ARGV[3])
local cur = math.floor(now / W)
local keep = 1 - (now - cur * W) / W
local p = KEYS[1]
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local rc = tonumber(redis.call('GET', p .. ':r:' .. cur) or '0')
local rp = tonumber(redis.call('GET', p .. ':r:' .. (cur - 1)) or '0')
local tc = tonumber(redis.call('GET', p .. ':t:' .. cur) or '0')
local tp = tonumber(redis.call('GET', p .. ':t:' .. (cur - 1)) or '0')
local r, tk = rp * keep + rc, tp * keep + tc
local function wait(prev, c, over)
  if prev > 0 and c < over then return math.ceil((prev * keep + c - over) / prev * W) end
  return math.ceil(keep * W)
end
local turn = math.ceil(keep * W)
if rpm > 0 and r + 1 > rpm then return {0, 0, math.max(tpm - tk, 0), wait(rp, rc, rpm - 1), turn, 1} end
if tpm > 0 and tk >= tpm then return {0, math.max(rpm - r, 0), 0, wait(tp, tc, tpm), turn, 2} end
local k = p .. ':r:' .. cur
redis.call('INCR', k)
redis.call('EXPIRE', k, 2 * W)
return {1, math.max(rpm - r - 1, 0), math.max(tpm - tk, 0), 0, turn, 0}
"""

CHARGE = """
local t = redis.call('TIME')
local W = tonumber(ARGV[2])
local k = KEYS[1] .. ':t:' .. math.floor(tonumber(t[1]) / W)
redis.call('INCRBY', k, ARGV[1])
redis.call('EXPIRE', k, 2 * W)
return 1
"""


@dataclass
class Verdict:
    """One request's admission: allowed or not, and the `x-ratelimit-*` header lines."""

    allowed: bool
    headers: bytes
    retry_after: int = 0
    what: str = ""  # "requests" or "tokens": the limit that refused


def rate_limited(grant: Grant, verdict: Verdict) -> ApiError:
    limit = grant.rpm if verdict.what == "requests" else grant.tpm
    per = "requests" if verdict.what == "requests" else "tokens"
    return ApiError(
        429,
        f"Rate limit reached for {per} per minute of this API key (limit {limit}); "
        f"retry in {verdict.retry_after}s.",
        type=per,
        code="rate_limit_exceeded",
        headers=((b"retry-after", str(verdict.retry_after).encode()),),
    )


def too_many_parallel(grant: Grant, limit: int) -> ApiError:
    return ApiError(
        429,
        f"This API key already has {limit} requests in flight on this frontend "
        f"(max_parallel {grant.max_parallel}); retry when one ends.",
        type="requests",
        code="rate_limit_exceeded",
        headers=((b"retry-after", b"1"),),
    )


def _headers(grant: Grant, left_requests: float, left_tokens: float, reset: int) -> bytes:
    parts: list[bytes] = []
    if grant.rpm is not None:
        parts.append(
            b"x-ratelimit-limit-requests: %d\r\nx-ratelimit-remaining-requests: %d\r\n"
            b"x-ratelimit-reset-requests: %ds\r\n" % (grant.rpm, max(left_requests, 0), reset)
        )
    if grant.tpm is not None:
        parts.append(
            b"x-ratelimit-limit-tokens: %d\r\nx-ratelimit-remaining-tokens: %d\r\n"
            b"x-ratelimit-reset-tokens: %ds\r\n" % (grant.tpm, max(left_tokens, 0), reset)
        )
    return b"".join(parts)


class LocalWindows:
    """The same sliding windows as `ADMIT`, in this process (the fallback, or no Redis)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, int], float] = {}

    def admit(self, grant: Grant, share: int, now: float | None = None) -> Verdict:
        now = time.time() if now is None else now
        cur = math.floor(now / WINDOW)
        keep = 1 - (now - cur * WINDOW) / WINDOW
        turn = math.ceil(keep * WINDOW)
        h = grant.hash
        rc, rp = self._counts.get((h, "r", cur), 0), self._counts.get((h, "r", cur - 1), 0)
        tc, tp = self._counts.get((h, "t", cur), 0), self._counts.get((h, "t", cur - 1), 0)
        r, tk = rp * keep + rc, tp * keep + tc
        rpm = math.ceil(grant.rpm / share) if grant.rpm else 0
        tpm = math.ceil(grant.tpm / share) if grant.tpm else 0
        if rpm and r + 1 > rpm:
            return Verdict(False, _headers(grant, 0, tpm - tk, turn), turn, "requests")
        if tpm and tk >= tpm:
            return Verdict(False, _headers(grant, rpm - r, 0, turn), turn, "tokens")
        self._counts[(h, "r", cur)] = rc + 1
        if len(self._counts) > 100_000:  # bounded: old windows go first
            self._forget(cur)
        return Verdict(True, _headers(grant, rpm - r - 1, tpm - tk, turn))

    def charge(self, grant: Grant, tokens: int, now: float | None = None) -> None:
        cur = math.floor((time.time() if now is None else now) / WINDOW)
        key = (grant.hash, "t", cur)
        self._counts[key] = self._counts.get(key, 0) + tokens

    def _forget(self, cur: int) -> None:
        for key in [k for k in self._counts if k[2] < cur - 1]:
            del self._counts[key]


class Limits:
    """The limits of API keys on one frontend (see the module's docstring)."""

    def __init__(self, url: str | None = None, *, prefix: str = "shoal:") -> None:
        self.url = url
        self.shown = safe_url(url) if url is not None else None  # for logs and /health
        self.prefix = prefix
        self.id = uuid.uuid4().hex
        self.local = LocalWindows()
        self.shared = False  # the Redis windows are in force
        self.frontends = 1  # N: the frontends that reported to Redis lately
        self.down_since: float | None = None
        self.last_error = ""
        self.in_flight: dict[str, int] = {}
        self._redis: Any = None
        self._admit: Any = None
        self._charge: Any = None
        self._task: asyncio.Task[None] | None = None
        self._charges: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self.url is None:
            return
        import redis.asyncio as redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self._redis = redis.Redis.from_url(
            self.url,
            socket_timeout=TIMEOUT,
            socket_connect_timeout=TIMEOUT,
            retry=Retry(NoBackoff(), 0),
        )
        self._admit = self._redis.register_script(ADMIT)
        self._charge = self._redis.register_script(CHARGE)
        await self._beat()  # shared at once when Redis answers; else local, and said so
        self._task = asyncio.create_task(self._beats(), name="limits:redis")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for task in list(self._charges):
            with contextlib.suppress(BaseException):
                await task
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.zrem(self.prefix + "frontends", self.id)
            await self._redis.aclose()

    # -- the request path ----------------------------------------------------------------

    @staticmethod
    def limited(grant: Grant) -> bool:
        return grant.rpm is not None or grant.tpm is not None or grant.max_parallel is not None

    def enter(self, grant: Grant) -> ApiError | None:
        """Count a request in flight; a 429 instead when `max_parallel` is reached here."""
        if grant.max_parallel is None:
            return None
        limit = math.ceil(grant.max_parallel / self.frontends)
        held = self.in_flight.get(grant.hash, 0)
        if held >= limit:
            return too_many_parallel(grant, limit)
        self.in_flight[grant.hash] = held + 1
        return None

    def leave(self, grant: Grant) -> None:
        if grant.max_parallel is None:
            return
        held = self.in_flight.get(grant.hash, 0) - 1
        if held > 0:
            self.in_flight[grant.hash] = held
        else:
            self.in_flight.pop(grant.hash, None)

    def needs_round_trip(self, grant: Grant) -> bool:
        return self.shared and (grant.rpm is not None or grant.tpm is not None)

    def admit_locally(self, grant: Grant) -> Verdict:
        return self.local.admit(grant, self.frontends if self.url else 1)

    async def admit(self, grant: Grant) -> Verdict:
        """The verdict for one request of `grant`: one Redis round trip while shared."""
        if not self.needs_round_trip(grant):
            return self.admit_locally(grant)
        try:
            allowed, left_r, left_t, wait, turn, which = await self._admit(
                keys=[self._key(grant)], args=[grant.rpm or 0, grant.tpm or 0, WINDOW]
            )
        except Exception as exc:  # Redis down: fail open onto the local windows
            self._down(exc)
            return self.admit_locally(grant)
        headers = _headers(grant, left_r, left_t, turn)
        if allowed:
            return Verdict(True, headers)
        return Verdict(False, headers, max(int(wait), 1), "requests" if which == 1 else "tokens")

    def charge(self, grant: Grant, tokens: int) -> None:
        """Charge `tokens` to the key's tpm window, after the fact (nothing awaits it)."""
        if grant.tpm is None or tokens <= 0:
            return
        if not self.shared:
            self.local.charge(grant, tokens)
            return
        task = asyncio.create_task(self._charge_shared(grant, tokens))
        self._charges.add(task)
        task.add_done_callback(self._charges.discard)

    async def _charge_shared(self, grant: Grant, tokens: int) -> None:
        try:
            await self._charge(keys=[self._key(grant)], args=[tokens, WINDOW])
        except Exception as exc:
            self._down(exc)
            self.local.charge(grant, tokens)

    def _key(self, grant: Grant) -> str:
        return f"{self.prefix}rl:{grant.hash[:32]}"

    # -- Redis' state ------------------------------------------------------------------------

    def _down(self, exc: Exception) -> None:
        if self.shared:
            log.warning(
                "limits: Redis at %s failed (%s): local limits at 1/%d of each key's",
                self.shown, exc, self.frontends,
            )  # fmt: skip
            self.down_since = time.time()
        self.shared = False
        self.last_error = f"{type(exc).__name__}: {exc}"

    async def _beat(self) -> None:
        """Report this frontend, count the others; shared again if Redis answers."""
        now = time.time()
        key = self.prefix + "frontends"
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.zadd(key, {self.id: now})
                pipe.zremrangebyscore(key, "-inf", now - FRONTENDS_TTL)
                pipe.zcard(key)
                pipe.expire(key, int(FRONTENDS_TTL * 3))
                *_, count, _ = await pipe.execute()
        except Exception as exc:
            if self.down_since is None:
                self.down_since = now
            self._down(exc)
            return
        self.frontends = max(int(count), 1)
        if not self.shared:
            log.info("limits: Redis at %s answers: shared limits in force", self.shown)
        self.shared, self.down_since, self.last_error = True, None, ""

    async def _beats(self) -> None:
        while True:
            await asyncio.sleep(BEAT)
            await self._beat()

    def describe(self) -> dict[str, Any]:
        """For `/health`: which limits are in force, and why."""
        if self.url is None:
            return {"state": "local", "reason": "no --limits: each frontend limits alone"}
        if self.shared:
            return {"state": "shared", "redis": self.shown, "frontends": self.frontends}
        return {
            "state": "fallback",
            "redis": self.shown,
            "reason": f"Redis unreachable ({self.last_error}): fail open, local limits at "
            f"1/{self.frontends} of each key's",
            "frontends": self.frontends,
            "since": self.down_since,
        }


def safe_url(url: str) -> str:
    """`url` without what may hold a password: its userinfo and its query (redis-py takes
    `?password=`); split by hand, as `urlsplit` refuses some URLs that still carry one."""
    scheme, sep, rest = url.partition("://")
    rest = rest.partition("#")[0]
    rest, query, _ = rest.partition("?")
    end = rest.find("/") if "/" in rest else len(rest)
    if sep and "@" in rest[:end]:
        rest = "***@" + rest[:end].rpartition("@")[2] + rest[end:]
    return f"{scheme}{sep}{rest}" + ("?***" if query else "")
