"""Fixtures for the frontend tests: a store, fake workers, and frontends started in-process."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import trustme

from shoal.frontend import Frontend, FrontendConfig
from shoal.store import Store, open_store
from tests.frontend.support import FakeWorker, FilteringDiscovery

StartWorker = Callable[..., Awaitable[FakeWorker]]
StartFrontend = Callable[..., Awaitable[Frontend]]


@pytest.fixture
def backend() -> str:
    """The store backend of a test; modules that must run on every backend override it."""
    return "memory"


@pytest.fixture
async def store(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Store]:
    if backend == "memory":
        url = f"memory://{uuid.uuid4().hex}"
    elif backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
    else:
        url = request.getfixturevalue("etcd_server").url
    s = await open_store(url)
    if backend == "etcd":  # one server for the session: start from an empty discovery
        for kv in (await s.get_prefix("shoal/v1/")).items:
            await s.delete(kv.key)
    yield s
    await s.close()


@pytest.fixture
def discovery(store: Store) -> FilteringDiscovery:
    return FilteringDiscovery(store)


@pytest.fixture
async def start_worker(store: Store) -> AsyncIterator[StartWorker]:
    """Start a fake worker and announce it in discovery (unless `register=False`)."""
    started: list[FakeWorker] = []

    async def start(*args: Any, register: bool = True, **kwargs: Any) -> FakeWorker:
        worker = await FakeWorker(*args, **kwargs).start()
        started.append(worker)
        if register:
            await worker.register(store)
        return worker

    yield start
    for worker in started:
        await worker.stop()
        if worker.lease is not None:
            with contextlib.suppress(Exception):
                await worker.lease.revoke()


@pytest.fixture
async def start_frontend(
    discovery: FilteringDiscovery, tmp_path: Path
) -> AsyncIterator[StartFrontend]:
    """Start an in-process frontend on a free port over the test's discovery."""
    started: list[Frontend] = []

    async def start(**settings: Any) -> Frontend:
        settings.setdefault("port", 0)
        settings.setdefault("cache_dir", tmp_path / f"cache-{len(started)}")
        settings.setdefault("drain_timeout", 2.0)
        frontend = Frontend(FrontendConfig(**settings), discovery=discovery)
        await frontend.start()
        started.append(frontend)
        return frontend

    yield start
    for frontend in started:
        await frontend.stop()


def openai_client(frontend: Frontend, **kwargs: Any) -> openai.AsyncOpenAI:
    kwargs.setdefault("api_key", "unused")
    kwargs.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", **kwargs)


@pytest.fixture
def certificates(tmp_path: Path) -> dict[str, Path]:
    """A CA made for the test, and a certificate it issued for localhost and 127.0.0.1."""
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(str(paths["cert"]), append=i > 0)
    return paths
