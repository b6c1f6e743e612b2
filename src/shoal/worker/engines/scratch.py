"""Engines' temporary directories that do not outlive their process.

An engine that writes files (the mocker's published model files, llama.cpp's metadata
files) makes its directory with `owned_temp_dir(prefix)`: it holds an `owner.pid` file, and
directories of that prefix whose owner's process is gone (SIGKILL, a crash, the OOM killer:
`stop()` never ran) are removed then. One whose owner is unknown or alive is left.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

OWNER_FILE = "owner.pid"


def sweep_files_of_dead_owners(directory: Path, prefix: str) -> None:
    """Remove the `prefix*` directories in `directory` whose owner's process is gone."""
    for path in directory.glob(f"{prefix}*"):
        try:
            pid = int((path / OWNER_FILE).read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError):
            continue  # (no owner written, another user's, or alive)


def owned_temp_dir(prefix: str) -> Path:
    """A new temporary directory `prefix*` owned by this process; the dead owners' swept."""
    made = Path(tempfile.mkdtemp(prefix=prefix))
    (made / OWNER_FILE).write_text(str(os.getpid()))
    sweep_files_of_dead_owners(made.parent, prefix)
    return made
