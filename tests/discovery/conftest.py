"""The store backends of the contract suite, for discovery tests that run on every one."""

from tests.store.conftest import backend

__all__ = ["backend"]
