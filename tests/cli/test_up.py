"""`shoal up` stopped while its workers start: a clean stop, no traceback, no stray task."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.processes import shoal


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
async def test_shoal_up_interrupted_during_start_up_stops_without_a_traceback(
    sig: signal.Signals, tmp_path: Path
) -> None:
    proc = await shoal(
        "up", "--workers", "2", "--port", "0", "--store", f"sqlite:///{tmp_path / 's.db'}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    seen = []
    while not any("workers      starting" in line for line in seen):
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line, f"exited early: {''.join(seen)}"
        seen.append(line)
    proc.send_signal(sig)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    text = "".join(seen) + out.decode() + err.decode()
    assert "Traceback" not in text and "never retrieved" not in text, text
    assert "shoal up: stopped" in text
    assert proc.returncode == 130


async def test_shoal_up_configured_by_the_environment_keeps_it_from_its_workers(
    tmp_path: Path,
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "SHOAL_PORT": str(port),
        "SHOAL_STORE": f"sqlite:///{tmp_path / 's.db'}",
        "SHOAL_WORKERS": "1",
        "SHOAL_CATALOG_PORT": "0",
    }
    proc = await shoal(
        "up", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        while not any("routing" in line for line in seen):
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert line, f"exited early: {''.join(seen)}"
            seen.append(line)
        assert any(f":{port}" in line for line in seen), seen
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
