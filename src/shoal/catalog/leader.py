"""`Leadership`: one holder of a role among replicas, by a key under a lease in the store.

The key `shoal/v1/leaders/{role}` is created atomically under the holder's lease: at most one
replica creates it, and it vanishes when the holder stops (its lease revoked) or dies (its
lease expires), so a waiting replica takes over within the lease TTL. A holder that finds
the key gone or under another lease has lost the role and does nothing until it wins again.

Make before break, both ways: a replica acts (`in_force()`) only while its own lease was
renewed within its TTL, so a leader cut off from the store, or frozen, stops counting itself
leader by the time its lease can have expired, and stops what it runs as soon as it runs
again; a replica that wins the key acts only one TTL after winning it, so the previous
holder, whose lease had ended when the key was free, has had that long to stop its work.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from shoal.discovery.keys import ROOT
from shoal.store import Lease, Store

log = logging.getLogger(__name__)

LEADERS = ROOT + "leaders/"


class LeadershipLost(Exception):
    """This replica's leadership is not in force: what it would start must not start."""


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
        self.leading = False  # this replica holds the key (it may still be waiting to act)
        self.won_at: float | None = None  # when it created the key (monotonic)

    async def hold(self) -> bool:
        """True if this process holds the role now and it is in force, taking the key if
        it is free (and then waiting one TTL before answering True)."""
        if self.lease is None or self.lease.lost.is_set():
            self.lease = await self.store.grant(self.ttl)  # renewed in the background
        held = await self.store.get(self.key)
        if held is None:
            mine = await self.store.create(self.key, self.identity, lease=self.lease.id)
            if mine:
                self.won_at = time.monotonic()
                log.info("%s: won; acting in %gs, once the last holder's lease is over",
                         self.key, self.ttl)  # fmt: skip
        else:
            mine = held.lease == self.lease.id and held.value == self.identity
        if mine != self.leading:
            log.info("%s: %s", self.key, "leading" if mine else "waiting for the leader")
        self.leading = mine
        return self.in_force()

    def in_force(self) -> bool:
        """True while this replica may act as the leader: it holds the key, has held it for
        one TTL, and its lease was renewed within the last TTL (no call: a clock read)."""
        lease, now = self.lease, time.monotonic()
        return (
            self.leading
            and lease is not None
            and not lease.lost.is_set()
            and now - lease.last_renewed < self.ttl
            and self.won_at is not None
            and now - self.won_at >= self.ttl
        )

    async def release(self) -> None:
        """Give the role up now (the key goes with the lease), so another replica takes it."""
        lease, self.lease, self.leading, self.won_at = self.lease, None, False, None
        if lease is not None:
            await lease.revoke()
