"""Layer 1: a revisioned key-value store with leases and gap-free prefix watches.

Backends are chosen by URL: `memory://`, `sqlite:///path/to/file.db`, `etcd://host:port[,host:port]`.
"""

from __future__ import annotations

import os
from pathlib import Path

from shoal.store.base import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    Delete,
    Event,
    InvalidKeyError,
    KeyRevision,
    KeyValue,
    Lease,
    LeaseNotFoundError,
    Listing,
    Put,
    Resync,
    Snapshot,
    Store,
    StoreError,
    StoreUnavailableError,
    ValueTooLargeError,
)
from shoal.store.lease import LeaseKeeper
from shoal.urls import redact_url

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "Delete",
    "Event",
    "InvalidKeyError",
    "KeyRevision",
    "KeyValue",
    "Lease",
    "LeaseKeeper",
    "LeaseNotFoundError",
    "Listing",
    "Put",
    "Resync",
    "Snapshot",
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "ValueTooLargeError",
    "default_store_url",
    "open_store",
]


def default_store_url() -> str:
    """`SHOAL_STORE`, else the embedded SQLite file in the user's state directory."""
    if url := os.environ.get("SHOAL_STORE"):
        return url
    import platformdirs

    state = Path(platformdirs.user_state_dir("shoal"))
    return f"sqlite:///{state / 'store.db'}"


async def open_store(url: str | None = None, *, connect_timeout: float = 5.0) -> Store:
    """Open the store at `url` (default: `default_store_url()`), failing within `connect_timeout`.

    Raises `StoreUnavailableError` naming the URL when the backend cannot be reached, and
    `ValueError` for a URL with an unknown scheme.
    """
    url = url or default_store_url()
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise ValueError(
            f"store URL {redact_url(url)!r} has no scheme: use memory://, sqlite:///path or etcd://host:port"
        )
    if scheme == "memory":
        from shoal.store.memory import MemoryStore

        return MemoryStore(url)
    if scheme == "sqlite":
        from shoal.store.sqlite import SQLiteStore

        return await SQLiteStore.open(url, connect_timeout=connect_timeout)
    if scheme == "etcd":
        from shoal.store.etcd import EtcdStore

        return await EtcdStore.open(url, connect_timeout=connect_timeout)
    raise ValueError(
        f"store URL {redact_url(url)!r}: unknown scheme {scheme!r} (memory, sqlite, etcd)"
    )
