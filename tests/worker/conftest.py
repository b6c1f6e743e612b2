"""Fixtures for the worker tests: real `shoal worker` processes on a SQLite store."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from shoal.store import Store, open_store
from tests.processes import Process, Processes

StartWorker = Callable[..., Awaitable[Process]]


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    s = await open_store(store_url)
    yield s
    await s.close()


@pytest.fixture
def start_worker(processes: Processes, store_url: str) -> StartWorker:
    """Start `shoal worker` processes; each is killed at the end of the test if still running."""

    async def start(
        *args: str,
        model: str = "mock-model",
        engine: str = "mocker",
        store: str | None = None,
        timeout: float = 20.0,
    ) -> Process:
        return await processes.worker(
            store or store_url, *args, model=model, engine=engine, timeout=timeout
        )

    return start
