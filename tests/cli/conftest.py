"""Fixtures for the CLI tests: `shoal worker` processes on a SQLite store, as in the worker
tests, for commands that read what workers registered (`shoal ls`)."""

from tests.worker.conftest import start_worker, store, store_url

__all__ = ["start_worker", "store", "store_url"]
