"""Usage of API keys, counted here and flushed to the catalog (`--catalog-url`).

`UsageBook.record` adds one answered request to the row of its (workspace, key, model, served
model, status class, minute): a few dict operations on the request's end, no I/O. Every
`interval` (10 s) the rows are sealed into a batch with a fresh id and the batches not yet
accepted are sent, oldest first, to the catalog's `POST /v1/usage`. A batch whose answer is
lost is sent again with the same id, and the catalog counts an id once: nothing is counted
twice. While the catalog cannot be reached the batches wait, at most `max_rows` rows in all:
beyond, the batches not sent yet are folded (rows of an hour into one, then a key's models
into one), counts kept; only if that is not enough are the oldest dropped, and counted as
dropped. `/health` reports the backlog.

What a client chose is bounded before it makes a row: a model name is cut to the catalog's
`LABEL_CHARS` (NULs replaced), a request's tokens to `MAX_TOKENS`, and at most `max_rows`
distinct rows are counted between two flushes (a request beyond adds to `dropped_rows`), and at
most `MAX_KEY_ROWS` of one key: a key without an allow-list may name any model (one that does not
exist is answered 404 and counted under its name), and one naming thousands would take the
room of every other key's usage; beyond, its requests are counted under `OTHER_MODELS`. A
batch goes in parts of at most `BATCH_BYTES` of JSON (under the catalog's 1 MiB body bound).
A part the catalog refuses for good (400, 413, 422) is dropped and counted, never retried
ahead of the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
import uuid
from collections import deque
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec

from shoal.discovery.grants import Grant
from shoal.urls import redact_url

if TYPE_CHECKING:  # (aiohttp is imported when usage is first flushed: most frontends never)
    import aiohttp

log = logging.getLogger(__name__)

Row = tuple[str, str, str, str, str, str]  # workspace, key, model, served, status class, minute
LABEL_CHARS = 400  # the catalog's bound on a row's model and served model
MAX_TOKENS = 10**9  # a request's tokens as counted (an engine's claim beyond is cut here)
BATCH_BYTES = 256 * 1024  # a batch's JSON at most (well under the catalog's 1 MiB bound)
ROW_BYTES = 256  # a row's JSON but its names: keys, minute, counts (each at most 16 digits)
SEAL_SLICE = 2048  # rows made into batches between two yields to the loop (~3 ms)
MAX_KEY_ROWS = 1000  # rows of one key between two flushes; beyond, under `OTHER_MODELS`
OTHER_MODELS = "(other models)"  # (parentheses and a space: no catalog name has them)
REFUSED = frozenset((400, 413, 422))  # the catalog will never take this batch


def label(name: str) -> str:
    """`name` as the catalog takes it in a row: at most `LABEL_CHARS`, no NUL."""
    return name[:LABEL_CHARS].replace("\x00", "\ufffd")


_CLASSES = ("2xx", "2xx", "2xx", "3xx", "4xx", "5xx")


def status_class(status: int) -> str:
    return _CLASSES[min(max(status // 100, 2), 5)]


async def _receipt(resp: aiohttp.ClientResponse, batch_id: str) -> None:
    """`RuntimeError` unless `resp` is the catalog's receipt of `batch_id` (a URL that
    points elsewhere, a login page in front of it, answers 200 too)."""
    try:
        answer = await resp.json(content_type=None)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or answer.get("batch_id") != batch_id:
        raise RuntimeError(
            f"the answer ({resp.status}, {resp.content_type}) is no receipt of the batch: "
            "is --catalog-url the catalog's?"
        )


class UsageBook:
    """This frontend's usage not yet accepted by the catalog (see the module's docstring)."""

    def __init__(
        self,
        catalog_url: str,
        *,
        token: str | None = None,
        interval: float = 10.0,
        max_rows: int = 100_000,
    ) -> None:
        self.url = catalog_url.rstrip("/") + "/v1/usage"
        self.shown = redact_url(self.url)  # for /health and logs: never `user:password@`
        rest = catalog_url.partition("://")[2]
        userinfo = rest[: min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))]
        userinfo = userinfo.rpartition("@")[0]
        # what an error message, or a refusal's text, may quote of the credentials
        self._secrets = [s for s in {userinfo, urllib.parse.unquote(userinfo), token} if s]
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.interval = interval
        self.max_rows = max_rows
        self.rows: dict[Row, list[int]] = {}
        self._key_rows: dict[tuple[str, str], int] = {}  # rows of each key in `rows`
        self.pending: deque[dict[str, Any]] = deque()
        self.pending_rows = 0
        self.dropped_rows = 0
        self.folded_rows = 0  # rows of the backlog folded into others (counts kept)
        self.sent_batches = 0
        self.last_error = ""
        self.last_refused = ""  # why the catalog last refused a batch for good
        self.last_flush: float | None = None
        self._minute = (0, "")  # (minute number, its ISO form): formatted once a minute
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()

    def record(
        self, grant: Grant, model: str, served: str, status: int, prompt: int, completion: int
    ) -> None:
        now = int(time.time() // 60)
        minute = self._minute
        if now != minute[0]:
            minute = self._minute = (now, datetime.fromtimestamp(now * 60, UTC).isoformat())
        key = (
            grant.workspace, grant.name, label(model), label(served), status_class(status),
            minute[1],
        )  # fmt: skip
        prompt, completion = min(prompt, MAX_TOKENS), min(completion, MAX_TOKENS)
        counts = self.rows.get(key)
        if counts is None:
            held = self._key_rows.get(key[:2], 0)
            if held >= MAX_KEY_ROWS:  # one key naming models by the thousand: folded
                key = (*key[:2], OTHER_MODELS, OTHER_MODELS, *key[4:])
                counts = self.rows.get(key)
        if counts is None:
            if len(self.rows) >= self.max_rows:  # bounded between two flushes too
                self.dropped_rows += 1
                return
            self.rows[key] = [1, prompt, completion]
            self._key_rows[key[:2]] = held + 1
        else:
            counts[0] += 1
            counts[1] += prompt
            counts[2] += completion

    async def start(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self._task = asyncio.create_task(self._flushes(), name="usage:flush")

    async def stop(self) -> None:
        """Stop flushing, after one last try to send what is counted; what the catalog
        never took is then lost, and said (an error naming its rows, requests and tokens)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        with contextlib.suppress(Exception):
            await self.flush()
        if self._session is not None:
            await self._session.close()
        if self.pending or self.rows:
            batches, self.pending, counted, self.rows = self.pending, deque(), self.rows, {}
            rows, requests, tokens, keys = await asyncio.to_thread(_totals, batches, counted)
            log.error(
                "usage lost at stop: %d rows (%d requests, %d tokens) of %d keys never reached "
                "the catalog at %s (%s)", rows, requests, tokens, keys, self.shown,
                self.last_error or "not sent",
            )  # fmt: skip

    async def _flushes(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.flush()
            except Exception:
                log.exception("flushing usage failed")

    async def seal(self) -> None:
        """The rows counted so far become batches of their own (each at most `BATCH_BYTES`
        of JSON), waiting to be sent: `SEAL_SLICE` rows between two yields to the loop
        (100,000 rows held it 0.13 s in one go); rows recorded meanwhile go in the next seal.
        The rows counted are taken out one by one, so they are freed a slice at a time too
        (100,000 of them freed at once held the loop ~20 ms): the newest first."""
        if not self.rows:
            return
        counted, self.rows = self.rows, {}
        keys, self._key_rows = self._key_rows, {}
        try:
            while self._seal(counted, SEAL_SLICE):
                _drop(keys, SEAL_SLICE)
                await asyncio.sleep(0)  # (a turn for the loop, not a wait)
            while keys:
                _drop(keys, 8 * SEAL_SLICE)
                await asyncio.sleep(0)
        finally:  # (cancelled: the frontend stops) what is left is sealed all the same
            self._seal(counted, None)
        await self._fit()

    def _seal(self, counted: dict[Row, list[int]], count: int | None) -> bool:
        """`count` rows taken out of `counted` (all: None) and made into batches; whether
        any is left."""
        rows: list[dict[str, Any]] = []
        size = 0
        pop = counted.popitem
        for _ in range(len(counted) if count is None else min(count, len(counted))):
            (w, k, m, s, c, minute), (n, p, t) = pop()
            rows.append(
                {"workspace": w, "key": k, "model": m, "served_model": s, "status_class": c,
                 "minute": minute, "requests": n, "prompt_tokens": p, "completion_tokens": t}
            )  # fmt: skip
            size += ROW_BYTES + 6 * (len(w) + len(k) + len(m) + len(s))  # 6: "\\u0001"
            if size >= BATCH_BYTES:
                self._batch(rows)
                rows, size = [], 0
        self._batch(rows)
        return bool(counted)

    def _batch(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.pending.append({"batch_id": uuid.uuid4().hex, "rows": rows})
        self.pending_rows += len(rows)

    async def _fit(self) -> None:
        """Hold the backlog to `max_rows` by losing resolution, not counts: the batches never
        sent (all but the first, which may have reached the catalog with its answer lost)
        are folded, first each row into its hour (the hour's first minute), then, if still
        over, each key's models into `OTHER_MODELS`. Only then are the oldest batches
        dropped (and counted as dropped). A key that floods its rows is thus folded with the
        others', never pushing their usage out (in a thread: 100,000 rows take ~0.1 s; the
        rows they replace are freed on the loop a slice at a time, `_let_go`)."""
        if self.pending_rows > self.max_rows and len(self.pending) > 1:
            head = self.pending.popleft()
            batches = list(self.pending)
            self.pending.clear()
            self.pending_rows = len(head["rows"])
            self.pending.append(head)
            try:
                rows = await asyncio.to_thread(_rows_of, batches)
                folded = 0
                for level in (1, 2):
                    before = len(rows)
                    replaced, rows = rows, await asyncio.to_thread(_fold, rows, level)
                    await _let_go(replaced)  # (level 2: the hours' rows, freed)
                    folded += before - len(rows)
                    if len(head["rows"]) + len(rows) <= self.max_rows:
                        break
                parts = await asyncio.to_thread(_split, rows)
            except BaseException:  # (cancelled: the frontend stops) kept as they were
                for batch in batches:
                    self._batch(batch["rows"])
                raise
            self.folded_rows += folded
            for part in parts:
                self._batch(part)
            for batch in batches:  # (the rows they held, freed)
                await _let_go(batch["rows"])
        while self.pending_rows > self.max_rows and len(self.pending) > 1:
            dropped = self.pending.popleft()  # bounded: the oldest go first
            self.pending_rows -= len(dropped["rows"])
            self.dropped_rows += len(dropped["rows"])
            log.warning("usage backlog full: %d rows dropped", len(dropped["rows"]))

    async def flush(self) -> None:
        """Seal, then send the waiting batches in order until one fails."""
        import aiohttp  # (loaded by `start`)

        async with self._flushing:
            await self.seal()
            while self.pending and self._session is not None:
                batch = self.pending[0]
                try:
                    async with self._session.post(
                        # (msgspec: `json.dumps` of a batch held the loop ~3 ms)
                        self.url,
                        data=msgspec.json.encode(batch),
                        headers=self.headers,
                    ) as resp:
                        if resp.status in REFUSED:  # never valid: the others go on
                            text = await self._answer(resp)
                            self._refused(f"the catalog refused a batch ({resp.status}): {text}")
                            continue
                        if resp.status >= 400:
                            text = await self._answer(resp)
                            raise RuntimeError(f"the catalog answered {resp.status}: {text}")
                        await _receipt(resp, batch["batch_id"])
                except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError) as exc:
                    why = self._scrubbed(str(exc))
                    self.last_error = f"{type(exc).__name__}: {why}"
                    log.warning("usage not flushed (%d batches wait): %s", len(self.pending), why)
                    return
                self.pending.popleft()
                self.pending_rows -= len(batch["rows"])
                self.sent_batches += 1
            self.last_error = ""
            self.last_flush = time.time()

    async def _answer(self, resp: aiohttp.ClientResponse) -> str:
        """The start of a refusal's text, scrubbed before it is cut (a token across the cut)."""
        head = await resp.content.read(4096)
        return self._scrubbed(head.decode(errors="replace"))[:300]

    def _scrubbed(self, text: str) -> str:
        """`text` (an error's, an answer's) without the catalog URL's credentials nor the
        token (a service that is not the catalog may quote the `Authorization` it got)."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _refused(self, why: str) -> None:
        batch = self.pending.popleft()
        self.pending_rows -= len(batch["rows"])
        self.dropped_rows += len(batch["rows"])
        self.last_refused = why
        log.warning("usage: %d rows dropped: %s", len(batch["rows"]), why)

    def describe(self) -> dict[str, Any]:
        """For `/health`: the backlog waiting for the catalog."""
        return {
            "catalog": self.shown,
            "pending_batches": len(self.pending),
            "pending_rows": self.pending_rows,
            "dropped_rows": self.dropped_rows,
            "folded_rows": self.folded_rows,
            "last_error": self.last_error or None,
            "last_refused": self.last_refused or None,
            "last_flush": self.last_flush,
        }


_NAMES = ("workspace", "key", "model", "served_model")
_COUNTS = ("requests", "prompt_tokens", "completion_tokens")
ROW_COUNT_MAX = 10**15  # the catalog's bound on a row's count


def _totals(
    batches: deque[dict[str, Any]], counted: dict[Row, list[int]]
) -> tuple[int, int, int, int]:
    """Rows, requests, tokens and keys of `batches` and of the rows `counted` (not sealed)."""
    rows = requests = tokens = 0
    keys: set[tuple[str, str]] = set()
    for batch in batches:
        for row in batch["rows"]:
            rows += 1
            requests += row["requests"]
            tokens += row["prompt_tokens"] + row["completion_tokens"]
            keys.add((row["workspace"], row["key"]))
    for (workspace, key, *_), (n, prompt, completion) in counted.items():
        rows += 1
        requests += n
        tokens += prompt + completion
        keys.add((workspace, key))
    return rows, requests, tokens, len(keys)


def _rows_of(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row for batch in batches for row in batch["rows"]]


def _split(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """`rows` in parts of at most `BATCH_BYTES` of JSON (as `UsageBook._seal` makes them)."""
    parts: list[list[dict[str, Any]]] = [[]]
    size = 0
    for row in rows:
        parts[-1].append(row)
        size += ROW_BYTES + 6 * sum(len(row[name]) for name in _NAMES)
        if size >= BATCH_BYTES:
            parts.append([])
            size = 0
    return parts


def _fold(rows: list[dict[str, Any]], level: int) -> list[dict[str, Any]]:
    """`rows` added up by hour (level 1: `minute` becomes its hour's first minute), and by
    key (level 2: every model and served model is `OTHER_MODELS` too)."""
    folded: dict[tuple[str, ...], dict[str, Any]] = {}
    for row in rows:
        minute = row["minute"]
        hour = minute[:14] + "00" + minute[16:]  # ("2026-12-06T21:52:00+00:00")
        model, served = (
            (OTHER_MODELS, OTHER_MODELS) if level > 1 else (row["model"], row["served_model"])
        )
        key = (row["workspace"], row["key"], model, served, row["status_class"], hour)
        into = folded.get(key)
        if into is None:
            folded[key] = {**row, "model": model, "served_model": served, "minute": hour}
        else:
            for count in _COUNTS:
                into[count] = min(into[count] + row[count], ROW_COUNT_MAX)
    return list(folded.values())


async def _let_go(rows: list[Any]) -> None:
    """Empty `rows` a `SEAL_SLICE` at a time, a turn of the loop before each: freeing is one
    C call holding the GIL (200,000 rows freed at once held the loop ~15-30 ms, as much from
    a thread), and the list, emptied in place, costs nothing to whoever drops it last."""
    while rows:
        await asyncio.sleep(0)
        del rows[-SEAL_SLICE:]


def _drop(held: dict[tuple[str, str], int], count: int) -> None:
    """Take `count` entries out of `held` (freed a slice at a time, as the rows)."""
    pop = held.popitem
    for _ in range(min(count, len(held))):
        pop()
