"""Whether discovery's store answers, as the watcher saw it last: for `/health` and
`/health/controllers`, which tell the store's outage (shared by every replica) apart from
this frontend's own trouble."""

from __future__ import annotations

import datetime
import time
from typing import Any


class StoreState:
    """Whether discovery's store answered the last listing, and since when it has not."""

    def __init__(self) -> None:
        self.unreachable_since: float | None = None  # wall-clock time of the first failure
        self.error: str | None = None

    def failed(self, exc: Exception) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = time.time()
        self.error = f"{type(exc).__name__}: {exc}"

    def answered(self) -> None:
        self.unreachable_since = self.error = None

    def report(self) -> dict[str, Any]:
        """For `/health`: reachable, or unreachable since when (ISO 8601, UTC) and why."""
        if self.unreachable_since is None:
            return {"reachable": True}
        return {
            "reachable": False,
            "unreachable_since": self._since(),
            "error": self.error,
        }

    def outage(self) -> str | None:
        """For `/health/controllers`: the outage in a sentence, or None while it answers."""
        if self.unreachable_since is None:
            return None
        return f"unreachable since {self._since()}: {self.error}"

    def _since(self) -> str:
        assert self.unreachable_since is not None
        since = datetime.datetime.fromtimestamp(self.unreachable_since, datetime.UTC)
        return since.isoformat(timespec="seconds")
