"""A frontend process gives the C library's free memory back once its start's metadata
fetches are done, and not before."""

from __future__ import annotations

import asyncio
import ctypes
from types import SimpleNamespace
from typing import Any, Literal, cast

import pytest

from shoal.cli import frontend as cli_frontend
from shoal.cli.frontend import trim_once_loaded
from tests.helpers import wait_for


class NoFetches(asyncio.Event):
    """The watcher's `no_fetches`, telling when someone waits for it."""

    waiting = False

    async def wait(self) -> Literal[True]:
        self.waiting = True
        return await super().wait()


async def test_the_heap_is_trimmed_once_no_metadata_fetch_is_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trims: list[int] = []
    malloc_trim = ctypes.CDLL(None).malloc_trim  # (glibc here: the real one, its calls noted)

    def noted(pad: int) -> int:
        trims.append(pad)
        return int(malloc_trim(pad))

    libc = SimpleNamespace(malloc_trim=noted)
    monkeypatch.setattr(cli_frontend, "ctypes", SimpleNamespace(CDLL=lambda _: libc))
    no_fetches = NoFetches()  # a fetch is in flight
    frontend = cast(Any, SimpleNamespace(watcher=SimpleNamespace(no_fetches=no_fetches)))
    trimming = asyncio.create_task(trim_once_loaded(frontend))
    await wait_for(lambda: no_fetches.waiting, timeout=5, message="waiting for the fetches")
    assert trims == [] and not trimming.done()  # (not while the cold start's downloads go on)
    no_fetches.set()
    await wait_for(trimming.done, timeout=5)
    assert trimming.result() is True
    assert trims == [0]  # trimmed, once
