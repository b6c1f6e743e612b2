"""The route watcher: keeps the `RouteTable` equal to the routes of its workspaces in the store.

One stream per workspace, the discovery pattern: read `shoal/v1/routes/{workspace}/`, then
watch it from the read's revision + 1, so no change falls between the two. A store `Resync`
(the watch lost its connection, or fell behind) replaces the workspace's routes with the
state it carries. When the watch itself breaks, the stream reads the prefix again (deletes
made meanwhile are in what the read no longer holds) and watches from that read.

Every `secrets_interval` seconds it also resolves the providers' secrets again, so a rotated
secret file or variable takes effect without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from shoal.frontend.virtual.virtual import SLICE_BYTES, SLICE_ROUTES, RouteTable, workspace_prefix
from shoal.store import Delete, Put, Resync, Store

log = logging.getLogger(__name__)


class RouteWatcher:
    """Applies the store's routes to `table`: a first read of every workspace, then watches."""

    def __init__(self, store: Store, table: RouteTable, *, secrets_interval: float = 30.0) -> None:
        self.store = store
        self.table = table
        self.secrets_interval = secrets_interval
        self.loaded = asyncio.Event()  # every workspace was read once
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Read every workspace (retrying until the store answers), then watch each."""
        for workspace in self.table.workspaces:
            revision = await self._read(workspace)
            self._tasks.append(
                asyncio.create_task(
                    self._watch(workspace, revision + 1), name=f"routes:{workspace}"
                )
            )
        self._tasks.append(asyncio.create_task(self._refresh_secrets(), name="routes:secrets"))
        self.loaded.set()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks.clear()

    async def _read(self, workspace: str) -> int:
        """Replace `workspace`'s routes with a fresh read; its revision. Retries until it works."""
        backoff = 0.1
        prefix = workspace_prefix(workspace)
        while True:
            try:
                snapshot = await self.store.get_prefix(prefix)
                # (inside the retry: whatever a value makes it raise must not end the
                # workspace's watch task, nor the frontend's start)
                await self.table.replace(workspace, snapshot.items)
            except Exception as exc:
                log.warning(
                    "reading routes of %r failed: %s; retrying in %.1fs", workspace, exc, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            return snapshot.revision

    async def _watch(self, workspace: str, start_revision: int) -> None:
        """Watch for ever; after a broken watch, read again and watch from that read. The
        loop turns every `SLICE_ROUTES` events or `SLICE_BYTES` of values, as in `replace`:
        a store hands a burst over without a wait (10,000 routes written at once held the
        loop 130-280 ms a step)."""
        prefix = workspace_prefix(workspace)
        backoff = 0.1
        while True:
            try:
                events = size = 0
                async for event in self.store.watch(prefix, start_revision):
                    await self._apply(workspace, event)
                    backoff = 0.1
                    events += 1
                    size += len(event.value) if isinstance(event, Put) else 0
                    if events >= SLICE_ROUTES or size >= SLICE_BYTES:
                        events = size = 0
                        await asyncio.sleep(0)
                log.warning("route watch of %r ended; restarting", workspace)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("route watch of %r failed: %s", workspace, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            start_revision = await self._read(workspace) + 1

    async def _refresh_secrets(self) -> None:
        while True:
            await asyncio.sleep(self.secrets_interval)
            try:
                await self.table.refresh_secrets()
            except Exception:
                log.exception("refreshing providers' secrets failed")

    async def _apply(self, workspace: str, event: Put | Delete | Resync) -> None:
        try:
            if isinstance(event, Put):
                self.table.put(event.key, event.value)
            elif isinstance(event, Delete):
                self.table.delete(event.key)
            else:
                await self.table.replace(workspace, event.items)
        except Exception:
            log.exception("failed to apply route event %s", event)
