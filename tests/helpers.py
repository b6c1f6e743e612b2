"""Shared test helpers: waiting on conditions with a deadline, free ports, subprocesses."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def wait_for(
    condition: Callable[[], Any | Awaitable[Any]],
    timeout: float = 10.0,
    interval: float = 0.02,
    message: str = "",
) -> Any:
    """Poll `condition` until it returns a truthy value; fail with `message` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
            last = result
        except Exception as exc:
            last = exc
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(
                f"condition not met within {timeout}s: {message or condition} (last: {last!r})"
            )
        await asyncio.sleep(interval)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
