"""The etcd store's connection: one `aetcd` client at a time, to one of the URL's endpoints,
through which every request goes (`EtcdConnection._call`), with a deadline, its errors
translated into the store's (`StoreUnavailableError` when etcd cannot be reached), and a
move to the next endpoint after a transport failure.

Every call has a deadline (`call_timeout`) and fails with `StoreUnavailableError` when etcd
cannot be reached; nothing waits forever. The gRPC channel reconnects on its own with a
short backoff (`_CHANNEL_OPTIONS`), and with several endpoints a transport failure moves
the client to the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.rpc

from shoal.store.base import (
    LeaseNotFoundError,
    Store,
    StoreError,
    StoreUnavailableError,
    ValueTooLargeError,
)
from shoal.urls import redact_url

log = logging.getLogger("shoal.store.etcd")  # (the backend's one logger, as it always was)

T = TypeVar("T")

DEFAULT_PORT = 2379

# gRPC channel options: reconnect quickly after an outage, and find a dead peer (a host
# gone silent, a frozen etcd) under an open watch within ~15 s. etcd refuses pings more
# often than every 5 s, and pings with no stream open. gRPC now times a ping out after
# `ping_timeout_ms` (default 60 s), no longer after `keepalive_timeout_ms`: set both.
# A message is at most 64 MiB: a listing's page aims at 16 MiB (`etcd_txn.PAGE_BYTES`) and
# one refused is read again smaller; a watch's responses are fragments of etcd's request
# bound (1.5 MiB by default).
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.ping_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 0,
    "grpc.http2.max_pings_without_data": 0,
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
}

# Transport-level gRPC outcomes: etcd (or the way to it) is not there right now.
_TRANSPORT_CODES = frozenset(
    {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "ABORTED", "INTERNAL"}
)


def parse_url(url: str) -> list[tuple[str, int]]:
    """The endpoints of `etcd://host:port[,host:port...]`, in order; the port defaults to 2379."""
    scheme, sep, rest = url.partition("://")
    if scheme != "etcd" or not sep:
        raise ValueError(f"not an etcd store URL: {redact_url(url)!r}")
    rest = rest.rstrip("/")
    if not rest or "/" in rest or "?" in rest or "@" in rest:
        raise ValueError(
            f"etcd store URL {redact_url(url)!r}: expected etcd://host:port[,host:port]"
        )
    endpoints: list[tuple[str, int]] = []
    for part in rest.split(","):
        part = part.strip()
        if part.startswith("["):  # [v6::addr]:port
            host, _, tail = part[1:].partition("]")
            host = f"[{host}]"
            port_s = tail.removeprefix(":")
        elif part.count(":") == 1:
            host, _, port_s = part.partition(":")
        else:
            host, port_s = part, ""
        try:
            port = int(port_s) if port_s else DEFAULT_PORT
        except ValueError:
            raise ValueError(f"etcd store URL {redact_url(url)!r}: bad port in {part!r}") from None
        if not host or not 0 < port < 65536:
            raise ValueError(f"etcd store URL {redact_url(url)!r}: bad endpoint {part!r}")
        endpoints.append((host, port))
    return endpoints


def _grpc_code(exc: BaseException) -> tuple[str | None, str]:
    """The gRPC status code name and details behind an aetcd or gRPC error, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, aetcd.rpc.AioRpcError):
            return seen.code().name, seen.details() or ""
        seen = seen.__cause__
    return None, str(exc)


def _cancelled_by_grpc() -> bool:
    """True when a `CancelledError` came from gRPC cancelling a call (its channel closed),
    not from someone cancelling the running task."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


class EtcdConnection(Store):
    """The connection of one store instance to etcd (see the module's docstring): the
    client in use, its generation (bumped at each move to another endpoint), and the
    requests made through it. Open with `open`."""

    def __init__(self, url: str, *, call_timeout: float = 5.0) -> None:
        super().__init__()
        self.url = url
        self._endpoints = parse_url(url)
        self._call_timeout = call_timeout
        self._index = 0
        self._generation = 0
        self._client: Any = None
        self._closed = False
        self._closed_event = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()

    def _new_client(self, index: int) -> Any:
        host, port = self._endpoints[index]
        return aetcd.Client(
            host=host,
            port=port,
            timeout=self._call_timeout,
            options=dict(_CHANNEL_OPTIONS),
        )

    @classmethod
    async def open(
        cls, url: str, *, connect_timeout: float = 5.0, call_timeout: float = 5.0
    ) -> Self:
        """Connect to the first reachable endpoint of `url` within `connect_timeout`.

        Raises `StoreUnavailableError` naming the URL when none answers in time.
        """
        store = cls(url, call_timeout=call_timeout)
        deadline = time.monotonic() + connect_timeout
        errors: list[str] = []
        n = len(store._endpoints)
        for i, (host, port) in enumerate(store._endpoints):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                errors.append(f"{host}:{port}: not tried (timeout)")
                continue
            client = store._new_client(i)
            try:
                async with asyncio.timeout(remaining / (n - i)):
                    await client.connect()
                    await client.get(b"\0shoal-probe")
            except Exception as exc:
                code, details = _grpc_code(exc)
                reason = details or code or type(exc).__name__
                errors.append(f"{host}:{port}: {reason}")
                with contextlib.suppress(Exception):
                    await client.close()
                continue
            store._client = client
            store._index = i
            return store
        raise StoreUnavailableError(
            f"etcd store {url} is unreachable within {connect_timeout}s ({'; '.join(errors)})"
        )

    async def _pause(self, delay: float) -> None:
        """Sleep `delay` seconds, or less if the store is closed meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closed_event.wait(), delay)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError(f"store {self.url} is closed")

    async def _current(self) -> tuple[Any, int]:
        """The client in use and its generation, connected."""
        self._check_open()
        if self._client is None:
            self._client = self._new_client(self._index)
        client, generation = self._client, self._generation
        await client.connect()
        return client, generation

    def _fail_over(self, generation: int) -> None:
        """After a transport failure on `generation`, move to the next endpoint (if any)."""
        if self._closed or generation != self._generation or len(self._endpoints) < 2:
            return
        old = self._client
        self._index = (self._index + 1) % len(self._endpoints)
        self._generation += 1
        self._client = self._new_client(self._index)
        host, port = self._endpoints[self._index]
        log.warning("etcd store %s: switching to endpoint %s:%s", self.url, host, port)
        if old is not None:
            self._spawn(self._close_client(old))

    @staticmethod
    async def _close_client(client: Any) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 5.0)

    def _spawn(self, coro: Awaitable[None]) -> None:
        async def run() -> None:
            await coro

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _translate(self, exc: BaseException, what: str) -> StoreError:
        """The shoal error for a failed etcd call."""
        if isinstance(exc, StoreError):
            return exc
        if self._closed:
            return StoreUnavailableError(f"store {self.url} is closed")
        if isinstance(exc, TimeoutError):
            return StoreUnavailableError(
                f"etcd store {self.url}: {what} timed out after {self._call_timeout}s"
            )
        code, details = _grpc_code(exc)
        if code == "NOT_FOUND" and "lease" in details:
            return LeaseNotFoundError(f"{what}: {details}")
        if code == "INVALID_ARGUMENT" and "too large" in details:
            return ValueTooLargeError(f"{what}: {details}")
        if code is None and isinstance(
            exc,
            aetcd.exceptions.ConnectionFailedError | aetcd.exceptions.ConnectionTimeoutError,
        ):
            code = "UNAVAILABLE"
        if code is None or code in _TRANSPORT_CODES:
            return StoreUnavailableError(
                f"etcd store {self.url} unavailable ({what}): {details or type(exc).__name__}"
            )
        return StoreError(f"etcd store {self.url}: {what} failed: {code}: {details}")

    async def _call(self, what: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Run one request on the current client with a deadline, translating errors."""
        client, generation = await self._current()
        try:
            async with asyncio.timeout(self._call_timeout + 1.0):
                return await fn(client)
        except (Exception, asyncio.CancelledError) as exc:
            raise self._failure(exc, what, generation) from exc

    def _failure(self, exc: BaseException, what: str, generation: int) -> StoreError:
        """Translate a failed call's error, failing over on transport errors.

        Re-raises a `CancelledError` aimed at the running task; one from gRPC (the call's
        channel was closed under it) is a transport error.
        """
        if isinstance(exc, asyncio.CancelledError):
            if not _cancelled_by_grpc():
                raise exc
            err: StoreError = StoreUnavailableError(
                f"etcd store {self.url} unavailable ({what}): call cancelled"
            )
        else:
            err = self._translate(exc, what)
        if isinstance(err, StoreUnavailableError):
            self._fail_over(generation)
        return err
