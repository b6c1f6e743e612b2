"""Opening a connection within a timeout (`upstream.Upstream.connect`), in a module the
compiled build leaves to the interpreter (docs/operations.md, "The compiled build").

Compiled, a coroutine keeps what it held across an await after it has ended (mypyc keeps a
coroutine's locals and temporaries in an object of its own, never cleared): the
`asyncio.timeout` it entered, which holds the task that ran it, which holds the coroutine, a
reference cycle left by every connect, with the request that waited for it. The
interpreter's coroutine lets go of its frame when it ends."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import TypeVar

P = TypeVar("P", bound=asyncio.BaseProtocol)


async def open_within(
    loop: asyncio.AbstractEventLoop,
    protocol: Callable[[], P],
    host: str,
    port: int,
    tls: ssl.SSLContext | None,
    seconds: float,
) -> P:
    """`loop.create_connection` to `host`:`port` (over TLS with `tls`, SNI and the
    certificate's name being `host`); `TimeoutError` after `seconds`."""
    # `asyncio.timeout`, not `wait_for`: on 3.11 `wait_for` can swallow a cancellation that
    # arrives as the connect completes (and runs the connect in a task of its own).
    async with asyncio.timeout(seconds):
        _, conn = await loop.create_connection(
            protocol, host, port, ssl=tls, server_hostname=host if tls is not None else None
        )
    return conn
