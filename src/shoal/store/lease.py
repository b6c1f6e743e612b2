"""`LeaseKeeper`: hold a process lease through store outages, re-granting when it is lost.

A holder whose lease was lost (the store was unreachable past the TTL, or the lease was
revoked behind its back) must not die: it grants a new lease and re-puts what it owns.
The keeper does the first part and calls `on_granted` for the second, again on every tick
until it succeeds, keeping the new lease alive while it runs; the replaced lease is revoked one TTL after that. `revoke()` means stop: no tick
after it grants or re-puts anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable

from shoal.store.base import Lease, LeaseNotFoundError, Store, StoreUnavailableError

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews one lease every TTL/3 and replaces it when it is lost.

    `tick()` does one unit of work (renew, or re-grant and re-put), so a control loop can
    drive it and beat a heartbeat after each success; `run()` drives it on its own.
    """

    def __init__(
        self,
        store: Store,
        ttl: float,
        on_granted: Callable[[Lease], Awaitable[None]],
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.on_granted = on_granted
        self.lease: Lease | None = None
        self.grants = 0
        self._reput_due = False  # `on_granted` has not yet succeeded for `lease`
        self._replaced: Lease | None = None  # revoked once the re-put under `lease` succeeds
        self._revoked = False
        self._retiring: dict[int, asyncio.TimerHandle] = {}  # replaced leases, revoked later
        self._retire_tasks: set[asyncio.Task[None]] = set()

    @property
    def interval(self) -> float:
        return max(self.ttl / 3, 0.05)

    @property
    def held(self) -> bool:
        """True while the current lease is believed alive."""
        return self.lease is not None and not self.lease.lost.is_set()

    async def start(self) -> Lease:
        """Grant the first lease and put what the holder owns."""
        await self._regrant()
        await self._reput()
        assert self.lease is not None
        return self.lease

    async def tick(self) -> None:
        """Renew the lease once, or replace it if lost, and re-put until that succeeds.

        Raises `StoreUnavailableError` on outage; after `revoke()` does nothing."""
        if self._revoked:
            return
        if self.lease is not None and not self.lease.lost.is_set():
            try:
                await self.lease.keepalive()
            except LeaseNotFoundError:
                log.warning("lease %x was lost; granting a new one", self.lease.id)
        if self.lease is None or self.lease.lost.is_set():
            await self._regrant()
        await self._reput()

    async def _regrant(self) -> None:
        lease = await self.store.grant(self.ttl, keepalive=False)
        if self._revoked:  # revoked while granting: this lease is not wanted
            with contextlib.suppress(Exception):
                await self.store.revoke(lease.id)
            return
        if self._replaced is None and self.lease is not None:
            self._replaced = self.lease
        self.lease = lease
        self.grants += 1
        self._reput_due = True

    async def _reput(self) -> None:
        """Call `on_granted` for the current lease if it has not succeeded yet, then end the
        lease it replaced."""
        lease = self.lease
        if not self._reput_due or lease is None or self._revoked:
            return
        # The re-put may take longer than the TTL (thousands of keys): the new lease is kept
        # alive beside it, or it would expire mid re-put, and the next one too, for ever.
        lease.start_keepalive()
        try:
            await self.on_granted(lease)
        except LeaseNotFoundError:
            lease.lost.set()  # expired before the re-put: the next tick grants another
            raise StoreUnavailableError(f"lease {lease.id:x} ended during the re-put") from None
        finally:
            lease.stop_keepalive()
        self._reput_due = False
        old, self._replaced = self._replaced, None
        if old is not None:
            # The old lease may have survived on the server (etcd restores leases after a
            # restart): end it, so what only it held does not linger until it expires, but
            # one TTL after the re-put: a reader that is a little behind (a listing under
            # way, a watch resyncing) sees both registrations of this live process for that
            # long, never a moment with neither.
            self._retiring[old.id] = asyncio.get_running_loop().call_later(
                self.ttl, self._retire, old.id
            )

    def _retire(self, lease_id: int) -> None:
        self._retiring.pop(lease_id, None)
        task = asyncio.create_task(self._revoke_quietly(lease_id), name=f"retire-{lease_id:x}")
        self._retire_tasks.add(task)
        task.add_done_callback(self._retire_tasks.discard)

    async def _revoke_quietly(self, lease_id: int) -> None:
        with contextlib.suppress(Exception):
            await self.store.revoke(lease_id)

    async def retire_now(self) -> None:
        """End the leases this one replaced now, not one TTL after the re-put: what they hold
        is superseded, and a holder that drains must not leave copies of its registration
        that the drain's changes (taints) never reach."""
        retiring, self._retiring = self._retiring, {}
        for lease_id, timer in retiring.items():
            timer.cancel()
            await self._revoke_quietly(lease_id)

    async def run(self) -> None:
        """Tick with backoff on outages until cancelled or revoked."""
        backoff = 0.1
        while not self._revoked:
            try:
                await self.tick()
                backoff = 0.1
                await asyncio.sleep(self.interval)
            except (StoreUnavailableError, OSError) as exc:
                log.warning("lease keepalive failed: %s", exc)
                await asyncio.sleep(min(backoff, self.interval) * (0.5 + random.random()))
                backoff = min(backoff * 2, 5.0)

    async def revoke(self) -> None:
        """Stop for good and end the lease (and any replaced one not yet retired): the
        holder's keys are deleted at once."""
        self._revoked = True
        await self.retire_now()
        if self.lease is not None:
            await self.lease.revoke()
