"""The local deployment backend with real `shoal worker` processes: replicas start, a dead one
is restarted, failing starts back off exponentially and end in a failure report."""

from __future__ import annotations

import asyncio
import os
import signal
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from shoal.catalog import backends
from shoal.catalog.backends import GIVE_UP_AFTER, LocalBackend, worker_command
from shoal.catalog.controller import stop_local_work
from shoal.catalog.leader import LeadershipLost
from shoal.catalog.resources import Deployment
from shoal.discovery import Discovery, Query
from shoal.store import open_store
from tests.helpers import wait_for


def deployment(**fields: Any) -> Deployment:
    now = datetime.now(UTC)
    return Deployment.model_validate({
        "name": "mock", "workspace": "team-a", "version": 1, "created_at": now,
        "updated_at": now, "model": "mock-llm", "engine": "mocker", "replicas": 2,
        "engine_args": {"speedup": 0}, **fields,
    })  # fmt: skip


def test_engine_args_become_worker_flags() -> None:
    command = worker_command(
        deployment(engine_args={"ttft_ms": 5, "speedup": 0, "off": False}), "memory://x"
    )
    assert command[3:] == [
        "worker", "--engine", "mocker", "--model", "mock-llm", "--namespace", "default",
        "--store", "memory://x", "--speedup", "0", "--ttft-ms", "5",
    ]  # fmt: skip


async def test_replicas_start_and_one_that_died_is_restarted(tmp_path: Path) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    backend = LocalBackend(store_url, tmp_path / "logs", backoff_first=0.05)
    wanted = deployment(namespace="backend-test")
    store = await open_store(store_url)
    try:
        await backend.start(wanted)
        await wait_for(lambda: _all_ready(backend, wanted), timeout=90, message="2 replicas ready")
        discovery = Discovery(store)
        assert len(await discovery.list(Query("backend-test"))) == 2
        victim = backend.pids("team-a", "mock")[0]
        os.kill(victim, signal.SIGKILL)

        async def replaced() -> bool:
            ready = await _all_ready(backend, wanted)
            return ready and victim not in backend.pids("team-a", "mock")

        await wait_for(replaced, timeout=90, message="the dead replica restarted")
        observed = await backend.poll(wanted)
        assert (observed.ready, observed.failed) == (2, False)
        await backend.poll(deployment(namespace="backend-test", replicas=1))  # scaled down
        assert len(backend.pids("team-a", "mock")) == 1
    finally:
        await backend.close()
        await store.close()
    assert backend.running() == set()


async def _all_ready(backend: LocalBackend, wanted: Deployment) -> bool:
    return (await backend.poll(wanted)).all_ready


async def test_failing_starts_back_off_exponentially_then_report_failure(tmp_path: Path) -> None:
    now = [0.0]
    backend = LocalBackend(
        "memory://unused", tmp_path / "logs", clock=lambda: now[0], backoff_first=1.0
    )
    broken = deployment(replicas=1, engine_args={"no-such-flag": 1})  # the worker exits 2
    await backend.start(broken)
    delays: list[float] = []
    for _ in range(GIVE_UP_AFTER):
        await wait_for(lambda: backend.pids("team-a", "mock") == [], timeout=60)
        observed = await backend.poll(broken)  # notes the death, schedules the restart
        replica = backend._running[("team-a", "mock")].replicas[0]
        delays.append(replica.not_before - now[0])
        if observed.failed:
            break
        assert backend.pids("team-a", "mock") == []  # not restarted before its backoff
        now[0] = replica.not_before
        await backend.poll(broken)
        assert len(backend.pids("team-a", "mock")) == 1
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0][: len(delays)]
    assert observed.failed and "exited with 2" in observed.message
    await backend.close()


async def test_a_worker_being_started_when_the_fence_stops_its_deployment_is_stopped_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leadership lapses while a replica's process is being made, and the fence stops the
    deployment meanwhile: the process it was making had no handle yet, so it was left
    running, tracked nowhere (a worker the next leader doubles, until this process ends).
    It is stopped as soon as it is made, and the start refused (`LeadershipLost`)."""
    leading = [True]
    backend = LocalBackend("memory://unused", tmp_path / "logs", may_start=lambda: leading[0])
    made: list[asyncio.subprocess.Process] = []
    spawn = asyncio.create_subprocess_exec

    async def spawned(*_command: str, **kwargs: Any) -> asyncio.subprocess.Process:
        leading[0] = False  # the lease lapses; the fence loop runs meanwhile
        await stop_local_work(backend)
        made.append(await spawn("sleep", "600", **kwargs))  # (a worker that is slow to go)
        return made[-1]

    monkeypatch.setattr(backends.asyncio, "create_subprocess_exec", spawned)
    try:
        with pytest.raises(LeadershipLost):
            await backend.start(deployment(replicas=1))
        assert len(made) == 1
        assert made[0].returncode is not None  # stopped, not left behind
        assert backend.running() == set()
    finally:
        await backend.close()
        for proc in made:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_a_deployment_asking_more_workers_than_the_host_allows_fails_alone(
    tmp_path: Path,
) -> None:
    """`replicas: 10000` started 10,000 worker processes on one host. The local backend now
    runs at most `max_workers` for all deployments: one asking more gets none of the rest and
    is failed, naming the bound, while the others run on; within the bound it starts."""
    backend = LocalBackend("memory://unused", tmp_path / "logs", max_workers=3)
    small = deployment(name="small", replicas=2)
    huge = deployment(name="huge", replicas=10_000)
    try:
        await backend.start(small)
        await backend.start(huge)
        observed = await backend.poll(huge)
        assert observed.failed and "at most 3 workers" in observed.message, observed.message
        assert "--max-local-workers" in observed.message
        assert backend.pids("team-a", "huge") == []
        assert len(backend.pids("team-a", "small")) == 2
        assert not (await backend.poll(small)).failed
        fits = deployment(name="huge", replicas=1)  # scaled down into the room left
        assert not (await backend.poll(fits)).failed
        assert len(backend.pids("team-a", "huge")) == 1
    finally:
        await backend.close()
    assert backend.running() == set()


async def test_a_deployment_waiting_for_workers_others_hold_starts_once_they_scale_down(
    tmp_path: Path,
) -> None:
    """A deployment that fits the host's bound alone but not beside the others' workers was
    failed (and in the controller put in ERROR, its workers stopped, for good), even when
    the others were being scaled down in the same pass. It now waits, saying so, not failed,
    and starts once there is room; only one asking more than the bound itself is failed."""
    backend = LocalBackend("memory://unused", tmp_path / "logs", max_workers=3)
    holder = deployment(name="holder", replicas=3)
    waiting = deployment(name="waiting", replicas=2)
    try:
        await backend.start(holder)
        await backend.start(waiting)
        observed = await backend.poll(waiting)
        assert not observed.failed and not observed.all_ready, observed
        assert "waiting" in observed.message and "3 run for other deployments" in observed.message
        assert backend.pids("team-a", "waiting") == []
        await backend.poll(deployment(name="holder", replicas=1))  # scaled down
        observed = await backend.poll(waiting)
        assert not observed.failed, observed.message
        assert len(backend.pids("team-a", "waiting")) == 2
        assert len(backend.pids("team-a", "holder")) == 1
        never = await backend.poll(deployment(name="never", replicas=4))
        assert never.failed and "at most 3 workers" in never.message, never.message
    finally:
        await backend.close()
    assert backend.running() == set()
