"""`RedisLink`: one dedicated connection to Redis for the request path (`limits.py`).

redis-py's client checks a connection out of its pool, packs, sends and reads each command in
its own turns of the loop; on the request path that machinery cost more than Redis' own work.
A link keeps one connection of redis-py's (with hiredis' parser when installed) for ever: the
calls made in one turn of the loop go in one write (at most `MAX_BATCH` calls: packing and
reading a batch holds the loop), their answers are matched in order, read by one task that lives
as long as the link; a batch unanswered after `timeout` fails (one timer per `timeout` while
busy, not one per call). Scripts run by EVALSHA; when Redis lost them (a restart, SCRIPT FLUSH)
a script is loaded once (SCRIPT LOAD) and the calls that found it missing are sent again. A call fails with its batch's error when the connection does; the next
call connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any

MAX_BATCH = 256  # calls in one write: a flush of many keys is sent over a few turns of the loop


class RedisLink:
    """One connection to the Redis at `url`, calls pipelined (see the module's docstring)."""

    def __init__(self, url: str, timeout: float) -> None:
        from redis.asyncio import ConnectionPool
        from redis.asyncio.connection import AbstractConnection

        self.timeout = timeout
        # The pool only reads the URL (host, port, password, db, TLS): its one connection is
        # this link's for ever, never checked out per call.
        pool = ConnectionPool.from_url(url, socket_connect_timeout=timeout)
        self.conn: AbstractConnection = pool.make_connection()  # type: ignore[no-untyped-call]
        self.round_trips = 0
        self._queue: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self._scripts: dict[str, str] = {}
        self._driver: asyncio.Task[None] | None = None
        self._idle: asyncio.Future[None] | None = None  # the driver waits for calls on it
        self._sent_at: float | None = None  # when the batch awaited was sent (loop time)
        self._watchdog: asyncio.TimerHandle | None = None
        self._expired = False

    def script(self, text: str) -> str:
        sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
        self._scripts[sha] = text
        return sha

    def call(self, *args: Any) -> asyncio.Future[Any]:
        """Send a command (with the others of this turn of the loop); its answer, or error."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((args, future))
        if self._driver is None:
            self._driver = loop.create_task(self._drive(), name="redis-link")
        elif self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        return future

    async def _drive(self) -> None:
        """Send what is queued, read the answers in order; then wait for more."""
        from redis.exceptions import NoScriptError, ResponseError

        conn = self.conn
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._idle = loop.create_future()
                await self._idle
                self._idle = None
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            again: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []  # scripts lost
            self._sent_at = loop.time()
            if self._watchdog is None:
                self._watchdog = loop.call_at(self._sent_at + self.timeout, self._watch)
            try:
                await conn.send_packed_command(
                    conn.pack_commands([args for args, _ in batch]), check_health=False
                )
                self.round_trips += 1
                for args, future in batch:
                    try:
                        reply = await conn.read_response()
                    except NoScriptError:  # Redis restarted: the script loaded, the call again
                        if args[0] == "EVALSHA":
                            again.append((("evalsha", *args[1:]), future))
                        else:  # lost again after its load (retried in lower case): whole
                            self._queue.append(
                                (("EVAL", self._scripts[args[1]], *args[2:]), future)
                            )
                        continue
                    except ResponseError as exc:
                        if not future.done():
                            future.set_exception(exc)
                        continue
                    if not future.done():
                        future.set_result(reply)
                if again:
                    self._queue[:0] = [*map(self._load, {args[1] for args, _ in again}), *again]
            except asyncio.CancelledError:
                if not self._expired:
                    raise  # closed
                self._expired = False
                if (task := asyncio.current_task()) is not None:
                    task.uncancel()
                self._fail(batch, TimeoutError(f"Redis did not answer in {self.timeout}s"))
            except Exception as exc:  # refused, cut: the connection is closed, and reopened
                self._fail(batch, exc)  # by the next call
            finally:
                self._sent_at = None

    def _load(self, sha: str) -> tuple[tuple[Any, ...], asyncio.Future[Any]]:
        """A SCRIPT LOAD of the script `sha`, sent before the calls that found it missing
        (its failure is theirs: nobody waits for it)."""
        loaded: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        loaded.add_done_callback(lambda done: done.cancelled() or done.exception())
        return ("SCRIPT", "LOAD", self._scripts[sha]), loaded

    def _fail(
        self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any]]], exc: Exception
    ) -> None:
        """This batch and what was queued meanwhile fail with `exc` (redis-py disconnected)."""
        failed, self._queue = batch + self._queue, []
        for _, future in failed:
            if not future.done():
                future.set_exception(exc)

    def _watch(self) -> None:
        """Cancel the batch awaited if it was sent more than `timeout` ago; else look again
        when it would be (one timer per `timeout`, not one per batch)."""
        self._watchdog = None
        sent_at = self._sent_at
        if sent_at is None or self._driver is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() >= sent_at + self.timeout - 0.001:
            self._expired = True
            self._driver.cancel()
        else:
            self._watchdog = loop.call_at(sent_at + self.timeout, self._watch)

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(BaseException):
                await self._driver
        await self.conn.disconnect()
