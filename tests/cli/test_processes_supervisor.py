"""The `--processes` supervisor's own rules, with a stand-in child (a few lines of Python that
print what a frontend child prints): whatever a slot's child does, the start ends, and a slot
that fails is logged and started again."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from shoal.cli import common, processes
from shoal.cli.common import cpu_quota
from shoal.cli.processes import CHILD, Child, Supervisor
from shoal.frontend import FrontendConfig
from tests.helpers import wait_for

READY = f"shoal {CHILD} ready: url=http://127.0.0.1:1 metrics=http://127.0.0.1:1/metrics"


def stand_in(*lines: str, on_sigterm: str = "lambda *_: sys.exit(0)") -> tuple[str, ...]:
    """A child that reads its settings, prints `lines`, and serves until SIGTERM."""
    script = (
        "import signal, sys, time\n"
        "sys.stdin.buffer.read()\n"
        f"signal.signal(signal.SIGTERM, {on_sigterm})\n"
        f"for line in {list(lines)!r}:\n"
        "    print(line, flush=True)\n"
        "while True:\n"  # (serving: until signalled)
        "    time.sleep(1)\n"
    )
    return (sys.executable, "-c", script)


def supervisor(
    command: tuple[str, ...], cls: type[Supervisor] = Supervisor, drain_timeout: float = 30
) -> Supervisor:
    config = FrontendConfig(host="127.0.0.1", port=0, drain_timeout=drain_timeout)
    running = cls(config, 1)
    running.child_command = command
    return running


async def stopped(running: asyncio.Task[int], supervised: Supervisor) -> int:
    """The supervisor's exit code after SIGTERM (its handler takes it); if it is stuck, its
    children are killed and it is cancelled, so a failing test leaves nothing behind."""
    try:
        if not running.done():
            os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(asyncio.shield(running), 20)
    finally:
        for child in supervised.children:
            if child.proc is not None and child.proc.returncode is None:
                child.proc.kill()
        running.cancel()


async def test_a_child_line_over_64_kib_is_passed_on_and_the_start_completes(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A stdout line over the pipe reader's 64 KiB limit ended the slot's task in silence:
    the ready line behind it was never read, and the start waited forever."""
    long_line = "x" * 100_000
    supervised = supervisor(stand_in(long_line, READY))
    running = asyncio.create_task(supervised.run())
    out = ""

    def started() -> bool:
        nonlocal out
        out += capfd.readouterr().out
        return "shoal frontend ready:" in out

    try:
        await wait_for(started, timeout=20, message="the start completes")
    finally:
        code = await stopped(running, supervised)
    assert code == 0 and long_line + "\n" in out


async def test_a_slot_whose_supervision_fails_is_logged_and_started_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Any failure of a slot (here an error of the supervisor's own, injected once, after a
    child died) is logged and the child started again after the backoff; never a slot left
    empty in silence."""

    class Faulty(Supervisor):
        runs = 0

        async def _run_once(self, child: Child, config: FrontendConfig, merged: str) -> Any:
            self.runs += 1
            if self.runs == 2:
                raise RuntimeError("injected supervisor fault")
            return await super()._run_once(child, config, merged)

    supervised = supervisor(stand_in(READY), Faulty)
    running = asyncio.create_task(supervised.run())
    child = supervised.children[0]
    try:
        await wait_for(lambda: child.ready.is_set(), timeout=20, message="first child ready")
        assert child.proc is not None
        first = child.proc
        first.kill()

        def started_again() -> bool:  # and ready: its ready line read
            proc = child.proc
            alive = proc is not first and proc is not None and proc.returncode is None
            return alive and child.metrics_url is not None

        await wait_for(lambda: child.restarts == 2 and started_again(), timeout=20,
                       message="the slot is started again after its failure")  # fmt: skip
    finally:
        code = await stopped(running, supervised)
    assert "injected supervisor fault" in caplog.text and code == 0


async def test_a_child_that_never_exits_on_sigterm_is_killed_once_its_drain_is_overdue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parent waited for every child without a bound: one child hung (stopped, stuck
    in a lock) kept `shoal frontend` from ever exiting after SIGTERM, and kept the port."""
    monkeypatch.setattr(processes, "STOP_GRACE", 0.5)
    supervised = supervisor(stand_in(READY, on_sigterm="signal.SIG_IGN"), drain_timeout=0.5)
    running = asyncio.create_task(supervised.run())
    child = supervised.children[0]
    await wait_for(lambda: child.ready.is_set(), timeout=20, message="child ready")
    code = await stopped(running, supervised)
    assert code == 1  # (not drained: killed)
    assert child.proc is not None and child.proc.returncode == -signal.SIGKILL


async def test_a_stop_during_a_restart_backoff_ends_at_once_and_exits_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM while a slot waited out its backoff made the parent exit 1 after a clean
    drain: the exit code of the child that had died before (and was being replaced) was
    counted as the drain's."""
    monkeypatch.setattr(processes, "BACKOFF_FIRST", 60.0)
    supervised = supervisor(stand_in(READY))
    running = asyncio.create_task(supervised.run())
    child = supervised.children[0]
    await wait_for(lambda: child.ready.is_set(), timeout=20, message="child ready")
    assert child.proc is not None
    child.proc.kill()
    await wait_for(lambda: child.metrics_url is None, timeout=20, message="in its backoff")
    assert await stopped(running, supervised) == 0


async def test_a_child_whose_metrics_do_not_answer_is_not_counted_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`shoal_frontend_processes_up` said 1 for a child that was running but did not answer
    (stopped, its loop stuck): its series were missing from the very answer that said so."""
    monkeypatch.setattr(processes, "SCRAPE_TIMEOUT", 0.5)
    hung: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)  # (kept open, never written to)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ready = f"shoal {CHILD} ready: url=http://127.0.0.1:1 metrics=http://127.0.0.1:{port}/metrics"
    supervised = supervisor(stand_in(ready))
    running = asyncio.create_task(supervised.run())
    child = supervised.children[0]
    try:
        await wait_for(lambda: child.ready.is_set(), timeout=20, message="child ready")
        request: Any = None
        body = (await supervised._metrics(request)).body
    finally:
        await stopped(running, supervised)
        for writer in hung:
            writer.close()
        server.close()
    assert isinstance(body, bytes)
    assert b'shoal_frontend_processes_up{process="0"} 0.0' in body, body


def test_auto_processes_follow_the_cgroups_cpu_quota_and_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--processes auto` counted the cores the process may run on, not the CPU time its
    container may use: a pod limited to 2 CPUs on a 96-core node started 96 frontends
    (each with its own fleet in memory and store watches), and past `MAX_PROCESSES` no cap."""
    v2 = tmp_path / "v2"
    (v2 / "kubepods" / "pod" / "ctr").mkdir(parents=True)
    (v2 / "kubepods" / "pod" / "cpu.max").write_text("250000 100000\n")
    (v2 / "kubepods" / "pod" / "ctr" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "v2.cgroup").write_text("0::/kubepods/pod/ctr\n")
    assert cpu_quota(v2, tmp_path / "v2.cgroup") == 3  # 2.5 CPUs: 3 processes
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker" / "abc").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "v1.cgroup").write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert cpu_quota(v1, tmp_path / "v1.cgroup") == 2
    (tmp_path / "none.cgroup").write_text("0::/\n")
    assert cpu_quota(v2, tmp_path / "none.cgroup") is None
    assert cpu_quota(v2, tmp_path / "absent") is None

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(96)))
    monkeypatch.setattr(common, "cpu_quota", lambda: 2)
    assert common.processes("auto") == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(4096)))
    monkeypatch.setattr(common, "cpu_quota", lambda: None)
    assert common.processes("auto") == common.MAX_PROCESSES


def serving_stand_in() -> tuple[str, ...]:
    """A child that serves HTTP on a private port (any path: 404) and names it as its
    metrics URL in its ready line, as a frontend child does."""
    script = (
        "import http.server, signal, sys, threading\n"
        "sys.stdin.buffer.read()\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "server = http.server.HTTPServer(('127.0.0.1', 0), http.server.BaseHTTPRequestHandler)\n"
        "port = server.server_address[1]\n"
        f"print('shoal {CHILD} ready: url=http://127.0.0.1:1 '\n"
        "      f'metrics=http://127.0.0.1:{port}/metrics', flush=True)\n"
        "server.serve_forever()\n"
    )
    return (sys.executable, "-c", script)


async def test_a_child_that_stops_answering_is_killed_and_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child stopped (SIGSTOP) or stuck in a loop that never yields still holds its share
    of new connections on the port: each one hung, and the parent, which only watched for
    exits, never replaced it. Nor did the orphan die with a parent SIGKILLed meanwhile (a
    stopped process does not act on the SIGTERM of PR_SET_PDEATHSIG)."""
    monkeypatch.setattr(processes, "WATCH_INTERVAL", 0.2)
    supervised = supervisor(serving_stand_in())
    running = asyncio.create_task(supervised.run())
    child = supervised.children[0]
    try:
        await wait_for(lambda: child.ready.is_set(), timeout=20, message="child ready")
        assert child.proc is not None
        first = child.proc
        await wait_for(lambda: child.answered >= 3, timeout=20, message="probes answered")
        assert first.returncode is None and child.restarts == 0  # a live child is left alone
        os.kill(first.pid, signal.SIGSTOP)
        await wait_for(lambda: first.returncode == -signal.SIGKILL, timeout=20,
                       message="the stopped child is killed")  # fmt: skip

        def replaced() -> bool:
            proc = child.proc
            return proc is not first and proc is not None and child.metrics_url is not None

        await wait_for(replaced, timeout=20, message="a new child serves in the slot")
        assert child.restarts == 1
    finally:
        code = await stopped(running, supervised)
    assert code == 0


async def test_a_stop_while_a_restarted_child_is_starting_exits_0(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SIGTERM while a slot's new child was still starting (importing: no handler yet) ended
    that child by the signal, and the parent counted it as a failed drain (exit 1). A child
    that never served had nothing to drain."""
    monkeypatch.setattr(processes, "BACKOFF_FIRST", 0.05)
    mark = tmp_path / "served"
    script = (
        "import os, signal, sys, time\n"
        "sys.stdin.buffer.read()\n"
        f"if not os.path.exists({str(mark)!r}):\n"
        f"    open({str(mark)!r}, 'w').close()\n"
        "    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        f"    print({READY!r}, flush=True)\n"
        "while True:\n"  # (the next one never gets as far as its handler)
        "    time.sleep(1)\n"
    )
    supervised = supervisor((sys.executable, "-c", script))
    running = asyncio.create_task(supervised.run())
    child = supervised.children[0]
    await wait_for(lambda: child.ready.is_set(), timeout=20, message="child ready")
    assert child.proc is not None
    first = child.proc
    first.kill()
    await wait_for(
        lambda: child.proc is not first and child.proc is not None and child.restarts == 1,
        timeout=20,
        message="its replacement starting",
    )
    assert await stopped(running, supervised) == 0
    assert child.proc is not None and child.proc.returncode == -signal.SIGTERM
