"""The store backends of the contract suite, for discovery tests that run on every one."""

from tests.store.conftest import backend, etcd_server

__all__ = ["backend", "etcd_server"]
