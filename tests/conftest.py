from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# tests/ is importable as a package for the shared helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.processes import Processes


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[Processes]:
    """Real `shoal` child processes of the test; any still running at its end are killed."""
    procs = Processes(tmp_path)
    yield procs
    await procs.close()
