from __future__ import annotations

import sys
from pathlib import Path

# tests/ is importable as a package for the shared helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
