"""A mocker's published files do not outlive it: removed when it stops, and those of a mocker
that died without stopping (SIGKILL: the tests' crash hook) by the next mocker to start."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shoal.worker.engines.mocker.engine import FILES_PREFIX, MockerEngine
from shoal.worker.engines.scratch import OWNER_FILE


def leave_files(directory: Path) -> None:
    """Files as mockers leave them: one whose process is gone, one alive (pid 1), one unknown."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    for name, owner in [("dead", dead.stdout.strip()), ("alive", "1"), ("unknown", None)]:
        left = directory / f"{FILES_PREFIX}{name}"
        (left / "base").mkdir(parents=True)
        if owner is not None:
            (left / OWNER_FILE).write_text(owner)


def names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


async def test_files_of_a_dead_mocker_are_swept_and_a_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    leave_files(tmp_path)
    engine = MockerEngine("m")
    await engine.start()
    try:
        left = names(tmp_path)
        assert f"{FILES_PREFIX}dead" not in left
        assert {f"{FILES_PREFIX}alive", f"{FILES_PREFIX}unknown"} <= left
        assert len(left) == 3  # and the new mocker's own
    finally:
        await engine.stop()
    assert names(tmp_path) == {f"{FILES_PREFIX}alive", f"{FILES_PREFIX}unknown"}
