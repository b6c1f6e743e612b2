"""Usage of API keys, counted here and flushed to the catalog (`--catalog-url`).

`UsageBook.record` adds one answered request to the row of its (workspace, key, model, served
model, status class, minute): a few dict operations on the request's end, no I/O. Every
`interval` (10 s) the rows are sealed into a batch with a fresh id and the batches not yet
accepted are sent, oldest first, to the catalog's `POST /v1/usage`. A batch whose answer is
lost is sent again with the same id, and the catalog counts an id once: nothing is counted
twice. While the catalog cannot be reached the batches wait, at most `max_rows` rows in all
(the oldest are dropped beyond, and counted as dropped); `/health` reports the backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from datetime import UTC, datetime
from typing import Any

import aiohttp

from shoal.discovery.grants import Grant

log = logging.getLogger(__name__)

Row = tuple[str, str, str, str, str, str]  # workspace, key, model, served, status class, minute


_CLASSES = ("2xx", "2xx", "2xx", "3xx", "4xx", "5xx")


def status_class(status: int) -> str:
    return _CLASSES[min(max(status // 100, 2), 5)]


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
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.interval = interval
        self.max_rows = max_rows
        self.rows: dict[Row, list[int]] = {}
        self.pending: deque[dict[str, Any]] = deque()
        self.pending_rows = 0
        self.dropped_rows = 0
        self.sent_batches = 0
        self.last_error = ""
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
        key = (grant.workspace, grant.name, model, served, status_class(status), minute[1])
        counts = self.rows.get(key)
        if counts is None:
            self.rows[key] = [1, prompt, completion]
        else:
            counts[0] += 1
            counts[1] += prompt
            counts[2] += completion

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self._task = asyncio.create_task(self._flushes(), name="usage:flush")

    async def stop(self) -> None:
        """Stop flushing, after one last try to send what is counted."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        with contextlib.suppress(Exception):
            await self.flush()
        if self._session is not None:
            await self._session.close()

    async def _flushes(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.flush()
            except Exception:
                log.exception("flushing usage failed")

    def seal(self) -> None:
        """The rows counted so far become a batch of their own, waiting to be sent."""
        if not self.rows:
            return
        rows = [
            {"workspace": w, "key": k, "model": m, "served_model": s, "status_class": c,
             "minute": minute, "requests": n, "prompt_tokens": p, "completion_tokens": t}
            for (w, k, m, s, c, minute), (n, p, t) in self.rows.items()
        ]  # fmt: skip
        self.rows = {}
        self.pending.append({"batch_id": uuid.uuid4().hex, "rows": rows})
        self.pending_rows += len(rows)
        while self.pending_rows > self.max_rows and len(self.pending) > 1:
            dropped = self.pending.popleft()  # bounded: the oldest go first
            self.pending_rows -= len(dropped["rows"])
            self.dropped_rows += len(dropped["rows"])
            log.warning("usage backlog full: %d rows dropped", len(dropped["rows"]))

    async def flush(self) -> None:
        """Seal, then send the waiting batches in order until one fails."""
        async with self._flushing:
            self.seal()
            while self.pending and self._session is not None:
                batch = self.pending[0]
                try:
                    async with self._session.post(
                        self.url, json=batch, headers=self.headers
                    ) as resp:
                        if resp.status >= 400:
                            text = (await resp.text())[:300]
                            raise RuntimeError(f"the catalog answered {resp.status}: {text}")
                except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError) as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.warning("usage not flushed (%d batches wait): %s", len(self.pending), exc)
                    return
                self.pending.popleft()
                self.pending_rows -= len(batch["rows"])
                self.sent_batches += 1
            self.last_error = ""
            self.last_flush = time.time()

    def describe(self) -> dict[str, Any]:
        """For `/health`: the backlog waiting for the catalog."""
        return {
            "catalog": self.url,
            "pending_batches": len(self.pending),
            "pending_rows": self.pending_rows,
            "dropped_rows": self.dropped_rows,
            "last_error": self.last_error or None,
            "last_flush": self.last_flush,
        }
