"""Store backends for the contract suite: memory, SQLite (a temp file) and a real etcd server."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shoal.store import Store, open_store
from tests.etcd_server import EtcdServer


class Backend:
    """How a test reaches one backend, and how it cuts a client off from it for a while."""

    name: str
    multiprocess = True

    def __init__(self, url: str) -> None:
        self.url = url

    async def open(self) -> Store:
        return await open_store(self.url)

    @contextlib.asynccontextmanager
    async def outage(self, *stores: Store) -> AsyncIterator[None]:
        """The given clients cannot reach the store inside the block."""
        for s in stores:
            s.set_unreachable(True)
        try:
            yield
        finally:
            for s in stores:
                s.set_unreachable(False)


class MemoryBackend(Backend):
    name = "memory"
    multiprocess = False


class SQLiteBackend(Backend):
    name = "sqlite"


class EtcdBackend(Backend):
    name = "etcd"

    def __init__(self, server: EtcdServer) -> None:
        super().__init__(server.url)
        self.server = server

    @contextlib.asynccontextmanager
    async def outage(self, *stores: Store) -> AsyncIterator[None]:
        """The server itself goes down (SIGKILL) and comes back with its data."""
        self.server.stop()
        try:
            yield
        finally:
            self.server.start()


@pytest.fixture(params=["memory", "sqlite", "etcd"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "memory":
        return MemoryBackend(f"memory://{uuid.uuid4().hex}")
    if request.param == "sqlite":
        return SQLiteBackend(f"sqlite:///{tmp_path / 'store.db'}")
    server: EtcdServer = request.getfixturevalue("etcd_server")
    return EtcdBackend(server)


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own, so tests sharing one etcd never see each other."""
    return f"test/{uuid.uuid4().hex[:12]}/"


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[Store]:
    s = await backend.open()
    yield s
    await s.close()


@pytest.fixture
async def etcd_store(etcd_server: EtcdServer) -> AsyncIterator[Store]:
    """A client of the etcd server alone, for the tests of etcd's own behaviour."""
    s = await open_store(etcd_server.url)
    yield s
    await s.close()
