"""`Gate`: the path of a request made with an API key, between its check and the proxy.

    max_parallel (this frontend) → rpm/tpm (`Limits.admit`: one Redis round trip while the
    windows are shared, none otherwise) → the proxy, answering through `Metered` → at the end:
    the request leaves max_parallel, its tokens are charged to tpm, and its usage is recorded.

A refused request answers 429 with `Retry-After` and the `x-ratelimit-*` headers (an admitted
one gets the headers too). While Redis answers, the round trip runs in a task the connection
holds as its response in progress, so a client that leaves cancels it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shoal.cards import ModelType
from shoal.discovery.grants import Grant
from shoal.frontend.http.request import ClientConnection, Request
from shoal.frontend.http.server import HttpConnection
from shoal.frontend.keys.limits import Limits, Verdict, rate_limited
from shoal.frontend.keys.metering import Metered

Forward = Callable[[Request, ClientConnection, ModelType], None]
# grant, model, served model, status, prompt tokens, completion tokens
Record = Callable[[Grant, str, str, int, int, int], None]


class _Pending:
    """The admission in progress, as the connection's response: cancelled if the client goes."""

    __slots__ = ("task",)

    def __init__(self, task: asyncio.Task[None]) -> None:
        self.task = task

    def cancel(self) -> None:
        self.task.cancel()


class Gate:
    def __init__(self, limits: Limits, forward: Forward, record: Record | None = None) -> None:
        self.limits = limits
        self.forward = forward
        self.record = record

    def handle(
        self, request: Request, conn: HttpConnection, kind: ModelType, grant: Grant, model: str
    ) -> None:
        limits = self.limits
        refused = limits.enter(grant)
        if refused is not None:
            conn.send_error(refused)
            self._done(grant, model, refused.status, 0, 0, "", entered=False)
            return

        def done(status: int, prompt: int, completion: int, served: str) -> None:
            self._done(grant, model, status, prompt, completion, served)

        metered = Metered(conn, len(request.body), done)
        if limits.needs_round_trip(grant):
            task = asyncio.create_task(self._admit(request, conn, metered, kind, grant))
            conn.produce_later(_Pending(task))
        else:
            self._go(limits.admit_locally(grant), request, conn, metered, kind, grant)

    async def _admit(
        self,
        request: Request,
        conn: HttpConnection,
        metered: Metered,
        kind: ModelType,
        grant: Grant,
    ) -> None:
        try:
            verdict = await self.limits.admit(grant)
        except asyncio.CancelledError:
            self.limits.leave(grant)  # the client left while Redis answered
            raise
        self._go(verdict, request, conn, metered, kind, grant)

    def _go(
        self,
        verdict: Verdict,
        request: Request,
        conn: HttpConnection,
        metered: Metered,
        kind: ModelType,
        grant: Grant,
    ) -> None:
        conn.extra_headers += verdict.headers
        if verdict.allowed:
            self.forward(request, metered, kind)
        else:
            metered.send_error(rate_limited(grant, verdict))

    def _done(
        self,
        grant: Grant,
        model: str,
        status: int,
        prompt: int,
        completion: int,
        served: str,
        entered: bool = True,
    ) -> None:
        if entered:
            self.limits.leave(grant)
        self.limits.charge(grant, prompt + completion)
        if self.record is not None:
            self.record(grant, model, served or model, status, prompt, completion)
