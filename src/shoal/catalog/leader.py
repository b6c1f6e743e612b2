"""`Leadership`: one holder of a role among replicas, by a key under a lease in the store.

The key `shoal/v1/leaders/{role}` is created atomically under the holder's lease: at most one
replica creates it, and it vanishes when the holder stops (its lease revoked) or dies (its
lease expires), so a waiting replica takes over within the lease TTL. A holder that finds
the key gone or under another lease has lost the role and does nothing until it wins again.
"""

from __future__ import annotations

import logging
import os
import socket

from shoal.discovery.keys import ROOT
from shoal.store import Lease, Store

log = logging.getLogger(__name__)

LEADERS = ROOT + "leaders/"


def leader_key(role: str) -> str:
    return LEADERS + role


class Leadership:
    """Holds `role` for this process while `hold()` keeps answering True."""

    def __init__(self, store: Store, role: str, *, ttl: float = 10.0) -> None:
        self.store = store
        self.key = leader_key(role)
        self.ttl = ttl
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}".encode()
        self.lease: Lease | None = None
        self.leading = False

    async def hold(self) -> bool:
        """True if this process holds the role now, taking it if the key is free."""
        if self.lease is None or self.lease.lost.is_set():
            self.lease = await self.store.grant(self.ttl)  # renewed in the background
        held = await self.store.get(self.key)
        if held is None:
            mine = await self.store.create(self.key, self.identity, lease=self.lease.id)
        else:
            mine = held.lease == self.lease.id and held.value == self.identity
        if mine != self.leading:
            log.info("%s: %s", self.key, "leading" if mine else "waiting for the leader")
        self.leading = mine
        return mine

    async def release(self) -> None:
        """Give the role up now (the key goes with the lease), so another replica takes it."""
        lease, self.lease, self.leading = self.lease, None, False
        if lease is not None:
            await lease.revoke()
