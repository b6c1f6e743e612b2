"""Every `shoal` command raises its soft limit of open files to the hard one; the programs it
starts get back the soft limit it started with (as Go's runtime does): inherited, a raised
limit broke a program using `select()` past 1,024 descriptors. The frontend's own helpers
that serve its requests keep the raised one. Each child is started the way its path starts
it, and its limit read from `/proc/<pid>/limits`."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal import open_files
from shoal.catalog.backends import LocalBackend
from shoal.cli.up import start_worker, stop_workers, wait_ready
from shoal.frontend.proxy.decoder_process import DecoderProcess
from tests.catalog.test_backends import deployment
from tests.helpers import wait_for

START_SOFT = 1024  # as distributions start processes


@pytest.fixture
def raised(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """This test process as a `shoal` command: started at a soft limit of `START_SOFT` under
    a higher hard one, then raised (`open_files.raise_limit`). Yields the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= START_SOFT:
        pytest.skip(f"the hard limit of open files ({hard}) leaves nothing to raise")
    monkeypatch.setattr(open_files, "_start_soft", None)
    resource.setrlimit(resource.RLIMIT_NOFILE, (START_SOFT, hard))
    try:
        open_files.raise_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sys.executable` (what each path runs a `shoal worker` with) replaced by a program that
    says it is ready, then waits: its limit is what its path gave it, not one it raised."""
    script = tmp_path / "probe"
    script.write_text('#!/bin/sh\necho "shoal worker ready: instance=1"\nexec sleep 60\n')
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))


def open_files_of(pid: int) -> tuple[int, int]:
    """The soft and hard limit of open files of process `pid`."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open-file limit for {pid}")


async def test_a_worker_the_catalog_starts_gets_the_limit_the_catalog_started_with(
    raised: int, probe: None, tmp_path: Path
) -> None:
    backend = LocalBackend("memory://unused", tmp_path / "logs")
    wanted = deployment(replicas=1)

    async def ready() -> bool:
        return (await backend.poll(wanted)).ready == 1

    try:
        await backend.start(wanted)
        await wait_for(ready, message="the probe ready")
        (pid,) = backend.pids("team-a", "mock")
        assert open_files_of(pid) == (START_SOFT, raised)
    finally:
        await backend.close()


async def test_a_worker_shoal_up_starts_gets_the_limit_shoal_up_started_with(
    raised: int, probe: None, tmp_path: Path
) -> None:
    worker = await start_worker(0, "mock-llm", "memory://unused", tmp_path)
    try:
        await wait_ready(worker, time.monotonic() + 30)
        assert open_files_of(worker.proc.pid) == (START_SOFT, raised)
    finally:
        await stop_workers([worker], force=True)


async def test_the_body_decoder_process_keeps_the_raised_limit(raised: int) -> None:
    """The decoder serves the frontend's requests: its limit is the frontend's."""
    decoder = DecoderProcess()
    try:
        await asyncio.to_thread(decoder.call, len, b"{}")
        assert decoder.pid is not None
        assert open_files_of(decoder.pid) == (raised, raised)
    finally:
        with contextlib.suppress(Exception):
            decoder.stop()


def test_a_process_that_never_raised_its_limit_starts_commands_as_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(open_files, "_start_soft", None)
    assert open_files.with_start_limit(["prog", "a b", "$HOME"]) == ["prog", "a b", "$HOME"]
