"""Fixtures for the worker tests: real `shoal worker` processes on a SQLite (or etcd) store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shoal.store import Store, open_store
from tests.etcd_server import EtcdServer

READY_RE = re.compile(
    r"^shoal worker ready: model=(?P<model>\S+) url=(?P<url>\S+) "
    r"status=(?P<status>\S+) instance=(?P<instance>[0-9a-f]+)$"
)


@dataclass
class WorkerProcess:
    """A `shoal worker` child process and what its ready line said."""

    proc: asyncio.subprocess.Process
    log: Path
    model: str = ""
    url: str = ""
    status_url: str = ""
    instance_id: int = 0
    extra: list[str] = field(default_factory=list)

    def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def wait(self, timeout: float = 15.0) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


StartWorker = Callable[..., Awaitable[WorkerProcess]]


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    s = await open_store(store_url)
    yield s
    await s.close()


@pytest.fixture
async def start_worker(tmp_path: Path, store_url: str) -> AsyncIterator[StartWorker]:
    """Start `shoal worker` processes; each is killed at the end of the test if still running."""
    started: list[WorkerProcess] = []

    async def start(
        *args: str, model: str = "mock-model", store: str | None = None, timeout: float = 20.0
    ) -> WorkerProcess:
        log = tmp_path / f"worker-{uuid.uuid4().hex[:8]}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SHOAL_STORE", None)
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "shoal.cli.main",
                "worker",
                "--model",
                model,
                "--store",
                store or store_url,
                *args,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                env=env,
            )
        worker = WorkerProcess(proc, log)
        started.append(worker)
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"worker not ready in {timeout}s:\n{worker.stderr()}")
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), remaining)
            except TimeoutError:
                continue
            if not line:
                await proc.wait()
                raise AssertionError(
                    f"worker exited with {proc.returncode} before ready:\n{worker.stderr()}"
                )
            match = READY_RE.match(line.decode().strip())
            if match:
                worker.model = match["model"]
                worker.url = match["url"]
                worker.status_url = match["status"]
                worker.instance_id = int(match["instance"], 16)
                return worker

    yield start
    for worker in started:
        if worker.proc.returncode is None:
            worker.proc.kill()
            with contextlib.suppress(Exception):
                await worker.wait(10)


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """A real etcd of this test's own (the test may stop and restart it)."""
    try:
        server = EtcdServer()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    server.start()
    yield server
    server.close()
