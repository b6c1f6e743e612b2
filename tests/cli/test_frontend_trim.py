"""A frontend process gives the C library's free memory back once its start's metadata
fetches are done, and not before."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from shoal.cli.frontend import trim_once_loaded
from tests.helpers import wait_for


async def test_the_heap_is_trimmed_once_no_metadata_fetch_is_in_flight() -> None:
    no_fetches = asyncio.Event()  # a fetch is in flight
    frontend = cast(Any, SimpleNamespace(watcher=SimpleNamespace(no_fetches=no_fetches)))
    trimming = asyncio.create_task(trim_once_loaded(frontend))
    await asyncio.sleep(0.05)
    assert not trimming.done()  # (not while the cold start's downloads go on)
    no_fetches.set()
    await wait_for(trimming.done, timeout=5)
    assert trimming.result() is True  # glibc here: trimmed
