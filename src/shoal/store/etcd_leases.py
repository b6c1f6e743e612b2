"""The etcd store's leases: granted, renewed and revoked through its connection
(`shoal.store.etcd_client`), and the short ones it revokes itself.

etcd raises lease TTLs to a minimum (2 s with the default election timing). For a lease
granted with a shorter TTL, the store that granted it revokes it itself once that TTL
passes without a renewal, so a living holder that stops renewing loses its keys on time;
if the holder dies, etcd's own (longer) TTL applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

import aetcd.rpc

from shoal.store.base import LeaseNotFoundError, StoreError, StoreUnavailableError
from shoal.store.etcd_client import EtcdConnection

log = logging.getLogger("shoal.store.etcd")  # (the backend's one logger, as it always was)


class EtcdLeases(EtcdConnection):
    """The leases of one store instance on etcd, and the reaper of the short ones (see the
    module's docstring)."""

    def __init__(self, url: str, *, call_timeout: float = 5.0) -> None:
        super().__init__(url, call_timeout=call_timeout)
        # Leases granted here whose requested TTL is below the one etcd gave: id -> deadline.
        self._short_leases: dict[int, float] = {}
        self._short_ttls: dict[int, float] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._reaper_wake = asyncio.Event()

    async def _grant(self, ttl: float) -> int:
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        seconds = max(1, math.ceil(ttl))
        sent = time.monotonic()

        async def fn(client: Any) -> Any:
            return await client.lease(seconds)

        lease = await self._call(f"grant lease ttl={ttl}", fn)
        lease_id = int(lease.id)
        if int(lease.ttl) > ttl:
            # etcd raised the TTL to its minimum: honour the requested one ourselves.
            self._short_ttls[lease_id] = ttl
            self._short_leases[lease_id] = sent + ttl
            self._ensure_reaper()
        return lease_id

    async def _keepalive(self, lease_id: int, ttl: float) -> bool:
        sent = time.monotonic()

        async def fn(client: Any) -> Any:
            call = client.leasestub.LeaseKeepAlive(
                timeout=self._call_timeout, metadata=client.metadata
            )
            try:
                await call.write(aetcd.rpc.LeaseKeepAliveRequest(ID=lease_id))
                await call.done_writing()
                async for reply in call:
                    return reply
                return None
            finally:
                call.cancel()

        reply = await self._call(f"keepalive lease {lease_id:x}", fn)
        if reply is None:
            raise StoreUnavailableError(
                f"etcd store {self.url}: keepalive of lease {lease_id:x} got no answer"
            )
        if int(reply.TTL) <= 0:
            self._forget_short(lease_id)
            return False
        if lease_id in self._short_leases:
            self._short_leases[lease_id] = sent + self._short_ttls[lease_id]
        return True

    async def revoke(self, lease_id: int) -> None:
        self._forget_short(lease_id)

        async def fn(client: Any) -> Any:
            return await client.revoke_lease(lease_id)

        with contextlib.suppress(LeaseNotFoundError):
            await self._call(f"revoke lease {lease_id:x}", fn)

    def _forget_short(self, lease_id: int) -> None:
        self._short_leases.pop(lease_id, None)
        self._short_ttls.pop(lease_id, None)

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(
                self._reap_forever(), name="etcd-store-lease-reaper"
            )
        self._reaper_wake.set()

    async def _reap_forever(self) -> None:
        """Revoke short leases (see the module doc) whose requested TTL ran out."""
        while not self._closed:
            now = time.monotonic()
            for lease_id, deadline in list(self._short_leases.items()):
                if deadline <= now:
                    log.debug("lease %x: ttl passed without keepalive, revoking", lease_id)
                    try:
                        await self.revoke(lease_id)
                    except StoreError as exc:  # etcd expires it on its own
                        log.debug("revoking expired lease %x: %s", lease_id, exc)
            self._reaper_wake.clear()
            timeout = None
            if self._short_leases:
                timeout = max(0.0, min(self._short_leases.values()) - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reaper_wake.wait(), timeout)
