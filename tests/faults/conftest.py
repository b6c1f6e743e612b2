"""Fixtures of the fault-injection suite: every case runs on the SQLite store and on a real
etcd, with real `shoal` processes and the official `openai` client."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shoal.store import Store, open_store
from tests.etcd_server import EtcdServer
from tests.faults.support import FAST, RECONCILE_INTERVAL
from tests.processes import Process, Processes


@pytest.fixture(params=["sqlite", "etcd"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    server: EtcdServer = request.getfixturevalue("own_etcd")
    return server.url


@pytest.fixture
def backend(store_url: str) -> str:
    return store_url.split(":", 1)[0]


@pytest.fixture
def namespace() -> str:
    return f"faults-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    """A client of the test's store, for what the test writes into discovery itself."""
    s = await open_store(store_url)
    yield s
    await s.close()


class Fleet:
    """Starts the test's workers and frontends as real processes in its namespace."""

    def __init__(self, processes: Processes, store_url: str, namespace: str, tmp: Path) -> None:
        self.processes = processes
        self.store_url = store_url
        self.namespace = namespace
        self.tmp = tmp

    async def worker(self, *args: str, model: str = "mock-llm") -> Process:
        return await self.processes.worker(
            self.store_url, "--namespace", self.namespace, *FAST, *args, model=model
        )

    async def frontend(self, *args: str, port: int = 0) -> Process:
        return await self.processes.start(
            "frontend", "--store", self.store_url, "--namespace", self.namespace,
            "--port", str(port), "--reconcile-interval", f"{RECONCILE_INTERVAL:g}",
            "--first-byte-timeout", "1", "--inhibit-seconds", "3",
            "--cache-dir", str(self.tmp / f"cache-{port}"), *args,
            ready="frontend",
        )  # fmt: skip


@pytest.fixture
def fleet(processes: Processes, store_url: str, namespace: str, tmp_path: Path) -> Fleet:
    return Fleet(processes, store_url, namespace, tmp_path)
