"""Serving an engine's (or a fake upstream's) aiohttp app on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from tests.helpers import free_port


class Server:
    """Serves an app on a fixed 127.0.0.1 port; it can stop and start again on that port.

    Handler cancellation is on, as in the worker: a client disconnect cancels the handler.
    """

    def __init__(self, app: web.Application) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._app = app
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(self._app, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[Server]:
    server = Server(app)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
