"""Rate limits of API keys: rpm and tpm shared by every frontend in Redis, max_parallel here.

Windows: each key has a sliding window per minute in Redis, estimated from two fixed windows
(the previous minute's count weighted by the part of it still inside the last 60 s, plus this
minute's), read and counted atomically by a Lua script (`LEASE`) on Redis' own clock, so
frontends agree whatever their clocks.

Leases: a request costs at most one round trip, and a busy key far fewer. `LEASE` admits the
requests of a key waiting here and leases an **allowance** beside them: requests this frontend
may admit alone, counted in Redis when leased (so the frontends together never admit more than
the limit), used until they run out or `LEASE_TIME` passes; what is left is then given back.
An allowance is sized to this frontend's recent rate for the key (rate x `LEASE_TIME`), and is
at most 1/(`LEASE_SHARE` x N) of the key's rpm, and of its tpm at the key's tokens per
request: while allowances are out, a key may be refused up to 1/`LEASE_SHARE` of its limit
early, never admitted over it. A key with a small limit (rpm < `LEASE_SHARE` x N) gets no
allowance: one round trip per request, exact. Requests that wait while a lease is asked join it.

Tokens: each request admitted reserves the key's tokens per request (the `windows.estimate`
of the first request waiting, made once when it came, or the key's average answer here when
that is larger; the first larger request waiting waits for the next `LEASE`, asked at its
size) in the tpm window, and holds them while it is in flight; once answered, its tokens are owed to the
current minute and its reservation given back to the minute it was made in (Redis' window,
told to the request when admitted; nothing if that minute left the sliding window), both
carried to Redis by the key's next `LEASE`, or by the flush every `FLUSH` seconds for a key
that asks nothing more: no round trip of its own. An allowance is used only while its
reserved tokens cover what is owed beyond the reservations given back, and only by a request
whose own estimate it covers: one declaring more asks Redis (the allowance is given back and
leased again at its size), so a key's small answers never let large requests in at their
average. A request is admitted while the key's token estimate is under `tpm`, so the last
one admitted may overshoot by its own size.

Redis is reached through one dedicated connection, calls pipelined (`RedisLink`).

Redis down (`--limits redis://...` refused, timed out): the frontend fails **open** onto
local windows at 1/N of each limit, N being the frontends that reported to Redis in its last
`FRONTENDS_TTL` seconds before the outage (each frontend adds itself to a sorted set every
`BEAT` seconds; frontends do not register in discovery), each key's starting at its 1/N of
what Redis last said it had used (`_fallback`). A beat that reaches Redis again
puts the shared windows back in force. `/health` says which are in force (`describe`).
Without `--limits`, every frontend applies the limits alone, as if N were 1.

Limits are a key's, whichever of its live secrets a request bears (a rotation's overlap does
not multiply them): they are counted per (workspace, name), never per secret.

`max_parallel` is counted here, per frontend, at ceil(max_parallel / N): a count in Redis
would need a lease per request to survive a frontend that dies mid-request, and a round trip
at the end of every request; per frontend it costs nothing and cannot leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from shoal.discovery.grants import Grant
from shoal.frontend.keys.redis_link import RedisLink
from shoal.frontend.keys.scripts import BEAT_SCRIPT, LEASE
from shoal.frontend.keys.windows import (
    MAX_KEYS,
    WINDOW,
    LocalWindows,
    Refusal,
    Ticket,
    headers_of,
)
from shoal.openai import ApiError
from shoal.urls import redact_url

log = logging.getLogger(__name__)

Ident = tuple[str, str]  # (workspace, name): a key's limits are shared by all its secrets

BEAT = 1.0  # seconds between two reports of this frontend to Redis (and probes when down)
FRONTENDS_TTL = 10.0  # a frontend not heard of for this long is not counted in N
TIMEOUT = 0.5  # seconds for a Redis call before it counts as down
LEASE_TIME = 0.5  # seconds an allowance lasts, and the time it is sized for
LEASE_SHARE = 32  # an allowance is at most 1/(LEASE_SHARE x N) of a key's limit
MAX_LEASE = 100_000  # requests in one allowance, whatever the limit
FLUSH = 0.25  # seconds between two flushes of what idle keys owe Redis
FLUSH_BATCH = 1000  # keys settled by one flush at most (the loop is not held long)


class Waiter(Protocol):
    """A request waiting for Redis' answer about its key (the gate's)."""

    cancelled: bool

    tokens: int  # the request's `estimate`, made once when it came

    @property
    def ticket(self) -> Ticket: ...  # told the tokens reserved for it in the local windows

    def admitted(self, headers: bytes) -> None: ...
    def refused(self, refusal: Refusal) -> None: ...


def rate_limited(grant: Grant, refusal: Refusal) -> ApiError:
    limit = grant.rpm if refusal.what == "requests" else grant.tpm
    per = "requests" if refusal.what == "requests" else "tokens"
    return ApiError(
        429,
        f"Rate limit reached for {per} per minute of this API key (limit {limit}); "
        f"retry in {refusal.retry_after}s.",
        type=per,
        code="rate_limit_exceeded",
        headers=((b"retry-after", str(refusal.retry_after).encode()),),
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


class _Key:
    """One key's state here while the windows are shared (see the module's docstring)."""

    __slots__ = (
        "asking", "avg", "given", "giving", "grant", "heard", "heard_of", "left_requests",
        "left_tokens", "owed", "per", "reset_at", "since", "units", "until", "used", "waiting", "window",
    )  # fmt: skip

    def __init__(self, grant: Grant) -> None:
        self.grant = grant  # the latest seen: its limits may change
        self.units = 0  # requests of the allowance left
        self.until = 0.0  # monotonic time the allowance ends
        self.window = 0  # the Redis window it was counted in
        self.per = 0  # tokens it reserved per request
        self.owed = 0  # tokens owed to Redis' current minute: answers' tokens
        self.given: dict[int, int] | None = None  # reservations to give back, per window...
        self.giving = 0  # ... in all
        self.used = 0  # requests admitted since the last lease...
        self.since = 0.0  # ... which was then (monotonic): the rate
        self.avg = 0.0  # tokens per answer (0: none seen yet)
        self.left_requests = self.left_tokens = 0  # Redis' last answer, for the headers
        self.reset_at = 0.0
        self.heard = 0.0  # when (monotonic) they came; 0: told to the fallback already
        self.heard_of = grant  # the limits Redis counted them against (`grant`'s may be newer)
        self.waiting: list[Waiter] = []  # (a deque is 760 bytes empty, for 100,000 keys)
        self.asking = False  # a LEASE is on its way

    @property
    def idle(self) -> bool:
        return not (self.units or self.owed or self.given or self.asking or self.waiting)


def _head_estimate(key: _Key) -> int:
    """The tokens of the first request waiting (not cancelled): a `LEASE` reserves that
    much per request, so the requests after it as large or smaller are admitted with it and
    the first larger one waits for the next `LEASE`, asked at its own size. (The largest of
    all waiting made one large request turn every small one queued with it large, and
    refused; a size known only to the queue's head never leaves a larger waiter unasked.)"""
    for waiter in key.waiting:
        if not waiter.cancelled:
            return waiter.tokens
    return 0


class Limits:
    """The limits of API keys on one frontend (see the module's docstring)."""

    def __init__(self, url: str | None = None, *, prefix: str = "shoal:") -> None:
        self.url = url
        self.shown = redact_url(url) if url is not None else None  # for logs and /health
        self.prefix = prefix
        self.id = uuid.uuid4().hex
        self.local = LocalWindows()
        self.shared = False  # the Redis windows are in force
        self.frontends = 1  # N: the frontends that reported to Redis lately
        self.down_since: float | None = None
        self.last_error = ""
        self.in_flight: dict[Ident, int] = {}
        self.link: RedisLink | None = None
        self.leases = self.settles = 0  # LEASEs sent to admit requests, and to settle only
        # workspace -> name -> state: keyed by the grant's own strings (a tuple a key cost
        # 130 bytes more, at 100,000 keys)
        self._keys: dict[str, dict[str, _Key]] = {}
        self._held = 0  # states in `_keys`
        self._unsettled: set[_Key] = set()  # keys that owe Redis tokens or an allowance
        self._tasks: list[asyncio.Task[None]] = []
        self._lease = self._beat_sha = ""

    async def start(self) -> None:
        if self.url is None:
            return
        self.link = RedisLink(self.url, TIMEOUT)
        self._lease = self.link.script(LEASE)
        self._beat_sha = self.link.script(BEAT_SCRIPT)
        await self._beat()  # shared at once when Redis answers; else local, and said so
        self._tasks = [
            asyncio.create_task(self._every(BEAT, self._beat), name="limits:beat"),
            asyncio.create_task(self._every(FLUSH, self._flush), name="limits:flush"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        if self.link is None:
            return
        with contextlib.suppress(Exception):
            await self._flush(final=True)
            await asyncio.wait_for(
                self.link.call("ZREM", self.prefix + "frontends", self.id), TIMEOUT
            )
        await self.link.close()

    # -- the request path ----------------------------------------------------------------

    def enter(self, grant: Grant) -> ApiError | None:
        """Count a request in flight; a 429 instead when `max_parallel` is reached here."""
        if grant.max_parallel is None:
            return None
        limit = math.ceil(grant.max_parallel / self.frontends)
        ident = (grant.workspace, grant.name)
        held = self.in_flight.get(ident, 0)
        if held >= limit:
            return too_many_parallel(grant, limit)
        self.in_flight[ident] = held + 1
        return None

    def leave(self, grant: Grant) -> None:
        if grant.max_parallel is None:
            return
        ident = (grant.workspace, grant.name)
        held = self.in_flight.get(ident, 0) - 1
        if held > 0:
            self.in_flight[ident] = held
        else:
            self.in_flight.pop(ident, None)

    def admit(
        self, grant: Grant, tokens: int = 0, ticket: Ticket | None = None
    ) -> bytes | Refusal | None:
        """One request's verdict, decided here: its `x-ratelimit-*` header lines (admitted),
        its `Refusal`, or None: Redis decides, the request `wait`s for it. `tokens`: its
        `estimate`; what it reserves is told to its `ticket` (and `charge`d back)."""
        if grant.rpm is None and grant.tpm is None:
            return b""
        if not self.shared:
            return self._fallback(grant, tokens, ticket)
        named = self._keys.get(grant.workspace)
        key = named.get(grant.name) if named is not None else None
        if key is None or key.units <= 0 or key.owed - key.giving > key.units * key.per:
            return None  # no allowance, or its reserved tokens no longer cover what is owed
        if grant.tpm is not None and tokens > key.per:
            return None  # it declares more than the allowance reserves per request: Redis
        now = time.monotonic()
        if now >= key.until:
            return None
        held = key.grant
        if held is not grant and (held.rpm != grant.rpm or held.tpm != grant.tpm):
            return None  # the limits changed: the allowance was not leased for them
        return self._take(key, now, ticket)

    def _fallback(self, grant: Grant, tokens: int, ticket: Ticket | None) -> bytes | Refusal:
        """The verdict of the local windows (Redis down, or no `--limits`). A key Redis
        answered about in the last minute first has its windows here start at its share of
        what Redis counted then (`LocalWindows.seed`): started empty, a key whose minute was
        used up before the outage was admitted its whole limit again (rpm 60 let 120 through
        that minute). Told once an outage, when the key is next asked about: not all keys
        at the outage's start, on the event loop at once."""
        share = self.frontends if self.url else 1
        named = self._keys.get(grant.workspace)
        key = named.get(grant.name) if named is not None else None
        if key is not None and key.heard:
            if time.monotonic() - key.heard < WINDOW:
                # what was used, by the limits Redis counted it against: the key's may have
                # changed since (rpm 30 with 6 left, raised to 300: 24 used, not 294)
                of = key.heard_of
                used_r = max(of.rpm - max(key.left_requests, 0), 0) if of.rpm else 0
                used_t = max(of.tpm - max(key.left_tokens, 0), 0) if of.tpm else 0
                self.local.seed(grant, share, used_r, used_t)
            key.heard = 0.0
        return self.local.admit(grant, share, tokens, ticket)

    def wait(self, grant: Grant, waiter: Waiter) -> None:
        """Queue `waiter` for Redis' answer about its key; it is told, unless cancelled."""
        key = self._key(grant)
        key.waiting.append(waiter)
        if not key.asking:
            self._ask(key, time.monotonic())

    def charge(
        self, grant: Grant, tokens: int, reserved: int = 0, shared: bool = False, minute: int = 0
    ) -> None:
        """Charge an answer's `tokens` to the key's tpm (after the fact; nothing awaits it)
        instead of the tokens `reserved` for it when admitted in `minute`: in Redis (`shared`),
        or in the local windows; the reservation is given back to its own minute, the tokens
        charged to the current one. (A request admitted before Redis failed or came back: its
        reservation is left where it is, to fade with its window.)"""
        if grant.tpm is None:
            return
        if not self.shared:
            if tokens > 0 or (reserved and not shared):
                self.local.charge(grant, tokens, 0 if shared else reserved, minute=minute)
            return
        key = self._key(grant)
        if tokens > 0:
            key.avg = tokens if not key.avg else key.avg + (tokens - key.avg) / 8
            key.owed += tokens
        if shared and reserved:
            given = key.given
            if given is None:
                key.given = {minute: reserved}
            else:
                given[minute] = given.get(minute, 0) + reserved
            key.giving += reserved
        if key.owed or key.given:
            self._unsettled.add(key)

    def _take(self, key: _Key, now: float, ticket: Ticket | None) -> bytes:
        """One request of the key's allowance: its header lines. The tokens it reserved in
        Redis are told to its `ticket`: its end owes what its answer used beyond (or short of)
        them, not before (it holds them while it is in flight)."""
        key.units = units = key.units - 1
        key.used += 1
        per = key.per
        if ticket is not None:
            ticket.reserved, ticket.shared, ticket.minute = per, True, key.window
        reset = math.ceil(key.reset_at - now)
        return headers_of(
            key.grant,
            key.left_requests + units,
            key.left_tokens + units * per,
            reset if reset > 1 else 1,
        )

    def _key(self, grant: Grant) -> _Key:
        named = self._keys.get(grant.workspace)
        if named is None:
            named = self._keys[grant.workspace] = {}
        key = named.get(grant.name)
        if key is not None:
            key.grant = grant
            return key
        if self._held >= MAX_KEYS:  # bounded: idle keys are forgotten
            for states in self._keys.values():
                for idle in [n for n, k in states.items() if k.idle]:
                    del states[idle]
            self._held = sum(map(len, self._keys.values()))
        key = named[grant.name] = _Key(grant)
        self._held += 1
        return key

    def _allowance(self, key: _Key, now: float, per: int) -> int:
        """Requests to lease beside those waiting (see the module's docstring)."""
        if not key.used:
            return 0
        grant = key.grant
        cap = MAX_LEASE
        share = LEASE_SHARE * self.frontends
        if grant.rpm is not None:
            cap = min(cap, grant.rpm // share)
        if grant.tpm is not None:
            cap = min(cap, grant.tpm // (share * per)) if per else 0
        if cap <= 0:
            return 0
        return min(cap, math.ceil(key.used / max(now - key.since, 1e-3) * LEASE_TIME))

    def _ask(self, key: _Key, now: float, give_back: bool = True) -> asyncio.Future[Any]:
        """Send the key's `LEASE`: for the requests waiting and an allowance, with what is
        owed and the allowance left (given back); only settle when nobody waits."""
        assert self.link is not None
        grant = key.grant
        per = max(math.ceil(key.avg), _head_estimate(key)) if grant.tpm is not None else 0
        want = len(key.waiting)
        if want:
            want += self._allowance(key, now, per)
            self.leases += 1
        else:
            self.settles += 1
        back = key.units if give_back else 0  # the allowance left, given back
        owed, key.owed, key.units = key.owed, 0, key.units - back
        given, key.given, key.giving = key.given, None, 0  # reservations, to their windows
        key.asking = True
        future = self.link.call(
            "EVALSHA", self._lease, 1, f"{self.prefix}rl:{_redis_id(grant)}",
            WINDOW, grant.rpm or 0, grant.tpm or 0, want, per, owed,
            back, back * key.per, key.window,
            *(() if given is None else itertools.chain.from_iterable(given.items())),
        )  # fmt: skip
        future.add_done_callback(functools.partial(self._answered, key, grant, want, per, owed))
        return future

    def _answered(
        self,
        key: _Key,
        asked: Grant,
        want: int,
        per: int,
        owed: int,
        future: asyncio.Future[Any],
    ) -> None:
        key.asking = False
        if future.cancelled():
            return
        grant = key.grant
        exc = future.exception()
        if exc is not None:  # Redis down: fail open onto the local windows
            self._down(exc)
            if owed > 0:
                self.local.charge(grant, owed, answer=False)
            for waiter in self._waiters(key):
                _tell(waiter, self._fallback(grant, waiter.tokens, waiter.ticket))
            return
        admitted, granted, left_r, left_t, wait, turn, window, which, other = future.result()
        now = time.monotonic()
        if not want:  # settled only: its answer says nothing of the windows
            pass
        elif not admitted:
            key.left_requests, key.left_tokens, key.reset_at = left_r, left_t, now + turn
            key.heard, key.heard_of = now, asked
            wait, other = max(int(wait), 1), max(int(other), 1)
            if which == 1:  # each limit's own reset
                headers = headers_of(grant, left_r, left_t, wait, other)
            else:
                headers = headers_of(grant, left_r, left_t, other, wait)
            refusal = Refusal(headers, wait, "requests" if which == 1 else "tokens")
            for waiter in self._waiters(key):
                waiter.refused(refusal)
        else:
            key.left_requests, key.left_tokens, key.reset_at = left_r, left_t, now + turn
            key.heard, key.heard_of = now, asked
            key.units, key.window, key.per = granted, window, per
            key.until, key.since, key.used = now + LEASE_TIME, now, 0
            told = 0
            while told < len(key.waiting) and key.units > 0:
                waiter = key.waiting[told]
                if per and not waiter.cancelled and waiter.tokens > per:
                    break  # came while asked, larger than leased for: the next `LEASE`
                told += 1
                if not waiter.cancelled:
                    ticket = waiter.ticket if grant.tpm is not None else None
                    waiter.admitted(self._take(key, now, ticket))
            del key.waiting[:told]
        if key.units > 0 or key.owed or key.given:
            self._unsettled.add(key)  # owes tokens, or an allowance to give back
        if any(not waiter.cancelled for waiter in key.waiting):
            self._ask(key, now)  # came while it was asked, more than were granted
        else:
            key.waiting.clear()

    @staticmethod
    def _waiters(key: _Key) -> list[Waiter]:
        waiting = [waiter for waiter in key.waiting if not waiter.cancelled]
        key.waiting.clear()
        return waiting

    async def _flush(self, final: bool = False) -> None:
        """Settle idle keys with Redis: tokens owed, allowances past their time (every one
        when `final`)."""
        if not self.shared or self.link is None:
            return
        now = time.monotonic()
        sent: list[asyncio.Future[Any]] = []
        for key in list(self._unsettled):
            if len(sent) >= FLUSH_BATCH and not final:
                break  # the rest stay unsettled: the next flush
            if key.asking:
                continue  # its answer puts it back if need be
            ended = key.units > 0 and (final or now >= key.until)
            if key.owed or key.given or ended:
                self._unsettled.discard(key)
                sent.append(self._ask(key, now, give_back=ended))
            elif key.units == 0:
                self._unsettled.discard(key)
        if final and sent:
            await asyncio.wait(sent, timeout=TIMEOUT)

    # -- Redis' state ------------------------------------------------------------------------

    def _down(self, exc: BaseException) -> None:
        if self.shared:
            log.warning(
                "limits: Redis at %s failed (%s): local limits at 1/%d of each key's",
                self.shown, exc, self.frontends,
            )  # fmt: skip
            self.down_since = time.time()
            for states in self._keys.values():  # allowances are void: nothing is admitted
                for key in states.values():  # on them
                    key.units = 0
        self.shared = False
        self.last_error = f"{type(exc).__name__}: {exc}"

    async def _beat(self) -> None:
        """Report this frontend, count the others; shared again if Redis answers."""
        assert self.link is not None
        try:
            count = await self.link.call(
                "EVALSHA", self._beat_sha, 1, self.prefix + "frontends", self.id, FRONTENDS_TTL
            )
        except Exception as exc:
            if self.down_since is None:
                self.down_since = time.time()
            self._down(exc)
            return
        self.frontends = max(int(count), 1)
        if not self.shared:
            log.info("limits: Redis at %s answers: shared limits in force", self.shown)
        self.shared, self.down_since, self.last_error = True, None, ""

    @staticmethod
    async def _every(seconds: float, work: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await work()
            except Exception:
                log.exception("limits: periodic work failed")

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


def _redis_id(grant: Grant) -> str:
    """The key's name in Redis: the same for each of its live secrets, on every frontend."""
    ident = f"{grant.workspace}\0{grant.name}".encode()
    return hashlib.sha256(ident).hexdigest()[:32]


def _tell(waiter: Waiter, verdict: bytes | Refusal) -> None:
    if isinstance(verdict, Refusal):
        waiter.refused(verdict)
    else:
        waiter.admitted(verdict)
