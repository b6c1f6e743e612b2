"""Deployment backends: what runs a deployment's workers, behind one small interface.

`Backend.start` launches a deployment's replicas, `poll` reports them and repairs drift
(a replica that died is restarted, with exponential backoff per replica; a changed replica
count is applied), `stop` ends them. `LocalBackend` runs `shoal worker` processes on this
host, supervised by the catalog process; a Kubernetes backend (docs/catalog.md) would make
a Deployment object per deployment and read its status instead.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hashlib
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.catalog.leader import LeadershipLost
from shoal.catalog.resources import Deployment
from shoal.open_files import with_start_limit

log = logging.getLogger(__name__)

READY_LINE = re.compile(r"^shoal worker ready: .*instance=(?P<instance>[0-9a-f]+)")
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 60.0
STABLE_AFTER = 30.0  # a replica up this long has its backoff reset
GIVE_UP_AFTER = 5  # failed starts in a row (never ready) before the deployment is in ERROR
MAX_LOCAL_WORKERS = 64  # worker processes at most for all deployments on this host (default)
STOP_TIMEOUT = 30.0  # a stopped worker's drain, before SIGKILL


@dataclass(frozen=True)
class Observed:
    """What a backend sees of one deployment: replicas ready, wanted, and what is wrong."""

    ready: int
    replicas: int
    failed: bool = False  # replicas keep failing to start: the deployment is in ERROR
    message: str = ""

    @property
    def all_ready(self) -> bool:
        return self.ready >= self.replicas and not self.failed


DeploymentId = tuple[str, str]  # (workspace, name)


class Backend(abc.ABC):
    """Runs deployments. Calls are short: none waits for workers to become ready."""

    @abc.abstractmethod
    async def start(self, deployment: Deployment) -> None:
        """Launch the deployment's replicas (idempotent: running ones are kept)."""

    @abc.abstractmethod
    async def poll(self, deployment: Deployment) -> Observed:
        """Report the replicas, restarting dead ones (with backoff) and applying `replicas`.
        A deployment this backend does not run (the controller restarted) is started."""

    @abc.abstractmethod
    async def stop(self, workspace: str, name: str) -> None:
        """Stop the deployment's replicas and wait for them (a no-op if none run)."""

    @abc.abstractmethod
    def running(self) -> set[DeploymentId]:
        """The deployments this backend runs replicas of."""

    async def close(self) -> None:
        """Stop everything this backend runs."""
        for workspace, name in sorted(self.running()):
            await self.stop(workspace, name)


def worker_command(deployment: Deployment, store_url: str) -> list[str]:
    """`shoal worker` for a deployment: engine, model, namespace, and `engine_args` as flags
    (`{"speedup": 0}` → `--speedup 0`; `true` → a bare flag)."""
    command = [
        sys.executable, "-m", "shoal.cli.main", "worker",
        "--engine", deployment.engine, "--model", deployment.model,
        "--namespace", deployment.namespace, "--store", store_url,
    ]  # fmt: skip
    for key, value in sorted(deployment.engine_args.items()):
        if value is False or value is None:
            continue
        command.append("--" + key.replace("_", "-"))
        if value is not True:
            command.append(str(value))
    return command


@dataclass
class _Replica:
    """One worker process and its restart record."""

    proc: asyncio.subprocess.Process | None = None
    ready: bool = False
    instance: str = ""
    started_at: float = 0.0
    restarts: int = 0  # deaths in a row (reset once up for STABLE_AFTER): the backoff exponent
    failures: int = 0  # starts in a row that died before becoming ready
    not_before: float = 0.0  # no restart before this (backoff)
    last_error: str = ""
    reader: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


@dataclass
class _Running:
    command: list[str]
    replicas: list[_Replica] = field(default_factory=list)
    refused: str = ""  # why it is failed: more replicas than the host's bound
    waiting: str = ""  # why its replicas are not all started: others hold the room


class LocalBackend(Backend):
    """Runs each replica as a `shoal worker` child process on this host, against `store_url`.

    Invariant: every replica slot has a live process, or a restart due at `not_before`
    (backoff doubling from 1 s to 60 s while starts keep failing, reset once a replica has
    stayed up for 30 s). Workers log to `log_dir/` (`log_file_name`). A process is started
    only while `may_start()` (the leadership is in force), and one whose deployment was
    stopped while it was being made (the fence) is stopped once made: none is left untracked.

    At most `max_workers` processes run at once for all deployments (`--max-local-workers`):
    a deployment asking more replicas than that is failed, saying so (the controller puts it
    in ERROR, as one whose workers keep failing), while every other deployment runs on
    (`replicas: 10000` started 10,000 processes on one host). One that fits the bound but not
    beside the other deployments' workers gets no new ones and waits, saying so (not failed:
    the others may be scaled down in the same pass, after it), until they leave it room.
    """

    def __init__(
        self,
        store_url: str,
        log_dir: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        backoff_first: float = BACKOFF_FIRST,
        may_start: Callable[[], bool] = lambda: True,
        max_workers: int = MAX_LOCAL_WORKERS,
    ) -> None:
        self.store_url = store_url
        self.max_workers = max_workers
        self.log_dir = log_dir
        self.clock = clock
        self.backoff_first = backoff_first
        self.may_start = may_start  # checked before every process starts (leadership)
        self._running: dict[DeploymentId, _Running] = {}

    def running(self) -> set[DeploymentId]:
        return set(self._running)

    def pids(self, workspace: str, name: str) -> list[int]:
        """The live worker processes of a deployment (for tests and `ps`)."""
        running = self._running.get((workspace, name))
        return [r.proc.pid for r in running.replicas if r.alive and r.proc] if running else []

    async def start(self, deployment: Deployment) -> None:
        await self._reconcile(deployment)

    async def poll(self, deployment: Deployment) -> Observed:
        running = await self._reconcile(deployment)
        ready = sum(1 for r in running.replicas if r.alive and r.ready)
        if running.refused:
            return Observed(ready, deployment.replicas, True, running.refused)
        if running.waiting:
            return Observed(ready, deployment.replicas, False, f"{ready}/{deployment.replicas}"
                            f" ready; {running.waiting}")  # fmt: skip
        failing = [r for r in running.replicas if r.failures >= GIVE_UP_AFTER]
        if failing:
            message = f"replicas keep failing to start: {failing[0].last_error}"
            return Observed(ready, deployment.replicas, True, message)
        waiting = [r for r in running.replicas if not r.alive and r.last_error]
        message = f"{ready}/{deployment.replicas} ready"
        if waiting:
            message += f"; restarting: {waiting[0].last_error}"
        return Observed(ready, deployment.replicas, False, message)

    async def _reconcile(self, deployment: Deployment) -> _Running:
        """Bring the replica slots to `replicas`, starting any that are due."""
        key = (deployment.workspace, deployment.name)
        command = worker_command(deployment, self.store_url)
        running = self._running.get(key)
        if running is not None and running.command != command:  # the spec changed: restart
            await self.stop(*key)
            running = None
        if running is None:
            running = self._running[key] = _Running(command)
        while len(running.replicas) > deployment.replicas:
            await _stop_replica(running.replicas.pop())
        others = sum(len(r.replicas) for k, r in self._running.items() if k != key)
        running.refused = running.waiting = ""
        if deployment.replicas > self.max_workers:  # it can never run here
            running.refused = (
                f"{deployment.replicas} replicas asked, but the local backend runs at most "
                f"{self.max_workers} workers on this host (--max-local-workers)"
            )
        elif deployment.replicas > self.max_workers - others:  # room others may give back
            running.waiting = (
                f"waiting for room: {deployment.replicas} replicas asked, the local backend "
                f"runs at most {self.max_workers} workers on this host (--max-local-workers) "
                f"and {others} run for other deployments"
            )
        while len(running.replicas) < deployment.replicas and not (
            running.refused or running.waiting
        ):
            running.replicas.append(_Replica())
        now = self.clock()
        for number, replica in enumerate(running.replicas):
            self._check(replica, now)
            if not replica.alive and now >= replica.not_before and replica.failures < GIVE_UP_AFTER:
                await self._launch(key, number, running.command, replica)
                if not self.may_start() or self._running.get(key) is not running:
                    # Stopped while its process was being made (the fence, leadership gone):
                    # that process had no handle to stop yet, and is tracked nowhere now.
                    await _stop_replica(replica)
                    raise LeadershipLost(f"{key[0]}/{key[1]}: stopped while a worker started")
        return running

    def _check(self, replica: _Replica, now: float) -> None:
        """Note a replica that died, and when it may start again."""
        if replica.proc is None or replica.proc.returncode is None:
            if replica.ready and now - replica.started_at > STABLE_AFTER:
                replica.restarts = replica.failures = 0
            return
        code, replica.proc = replica.proc.returncode, None
        replica.last_error = f"worker exited with {code}"
        replica.failures = 0 if replica.ready else replica.failures + 1
        replica.restarts += 1
        replica.ready = False
        delay = min(self.backoff_first * 2 ** (replica.restarts - 1), BACKOFF_MAX)
        replica.not_before = now + delay
        log.warning("%s; restart in %.1fs", replica.last_error, delay)

    async def _launch(
        self, key: DeploymentId, number: int, command: list[str], replica: _Replica
    ) -> None:
        if not self.may_start():
            raise LeadershipLost(f"not starting a worker of {key[0]}/{key[1]}: not the leader")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / log_file_name(key, number)
        with log_path.open("ab") as log_file:
            replica.proc = await asyncio.create_subprocess_exec(
                *with_start_limit(command),  # (not this process's raised open-file limit)
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        replica.ready, replica.started_at = False, self.clock()
        replica.reader = asyncio.create_task(
            _read_ready(replica), name=f"deployment:{key[0]}/{key[1]}#{number}"
        )

    async def stop(self, workspace: str, name: str) -> None:
        running = self._running.pop((workspace, name), None)
        if running is not None:
            await asyncio.gather(*(_stop_replica(r) for r in running.replicas))


async def _read_ready(replica: _Replica) -> None:
    """Read the worker's stdout: its ready line marks the replica ready."""
    proc = replica.proc
    assert proc is not None and proc.stdout is not None
    while line := await proc.stdout.readline():
        if match := READY_LINE.match(line.decode(errors="replace").strip()):
            replica.ready, replica.instance = True, match["instance"]


async def _stop_replica(replica: _Replica, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM (the worker drains), then SIGKILL after `timeout`."""
    proc = replica.proc
    if proc is not None and proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    if replica.reader is not None:
        replica.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await replica.reader
    replica.proc, replica.ready = None, False


def _die_with_parent() -> None:
    """In the child: SIGTERM (a drain) if the catalog process dies without stopping it, so a
    crashed leader leaves no workers the next leader does not know about (Linux only)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def log_file_name(key: DeploymentId, number: int) -> str:
    """`{workspace}-{name}-{hash}-{n}.log`: readable, at most 120 bytes whatever the names
    (a file name is at most 255), and never shared by two deployments (`a/b` and `a_b`)."""
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", f"{key[0]}-{key[1]}")[:80]
    digest = hashlib.sha256(f"{key[0]}/{key[1]}".encode()).hexdigest()[:12]
    return f"{readable}-{digest}-{number}.log"
