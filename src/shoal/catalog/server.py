"""The catalog API served by uvicorn inside the caller's event loop (`serve`, `shoal up`).

The socket is bound here, before uvicorn starts, so a busy port is an `OSError` for the
caller to report, and uvicorn never installs signal handlers: the command owns Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from shoal.catalog.api import create_app
from shoal.catalog.database import migrate, open_engine
from shoal.catalog.usage import UsageRetention
from shoal.controllers import ControllerManager, readiness


@dataclass
class CatalogConfig:
    database_url: str
    host: str = "127.0.0.1"
    port: int = 8100
    admin_token: str | None = None
    public_read: bool = False
    key_pepper: str = ""  # hashed with API key secrets; the frontends checking keys share it
    usage_retention_days: float = 90.0  # usage older is deleted (0: kept for ever)
    usage_prune_interval: float = 3600.0  # seconds between two passes of the retention


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers, telling when start-up is over."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.startup_done = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.startup_done.set()


class CatalogServer:
    """Migrates the database, then serves the API until `stop()`."""

    def __init__(self, config: CatalogConfig) -> None:
        self.config = config
        self.engine: AsyncEngine | None = None
        self._server: _Server | None = None
        self._socket: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = config.port
        self.controllers: ControllerManager | None = None  # the loops /health/controllers reports
        self.retention: UsageRetention | None = None
        self._retention_task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Migrate and start serving; raises (`OSError`, database errors) before serving."""
        self.engine = open_engine(self.config.database_url)
        await migrate(self.engine)
        app = create_app(
            self.engine,
            admin_token=self.config.admin_token,
            public_read=self.config.public_read,
            migrate_on_start=False,
            key_pepper=self.config.key_pepper,
        )
        self._health_routes(app)
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError:
            sock.close()
            raise
        sock.listen(1024)
        sock.setblocking(False)
        self._socket, self.port = sock, sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve([sock]), name="catalog-server")
        await self._server.startup_done.wait()
        if not self._server.started:
            await self.stop()
            raise RuntimeError("the catalog API did not start (see the log)")
        if self.config.usage_retention_days > 0:
            self.retention = UsageRetention(
                self.engine, self.config.usage_retention_days, self.config.usage_prune_interval
            )
            self._retention_task = asyncio.create_task(
                self.retention.run(), name="catalog-usage-retention"
            )

    def _health_routes(self, app: FastAPI) -> None:
        """The probes and the report, unauthenticated. `GET /live`: 200 while the API serves.
        `GET /ready`: 503 only while a loop of `controllers` is stuck on its own work, which
        another replica would not share; never for steps failing on the store or the
        database, shared by every replica. `GET /health/controllers`: 200 while every loop
        is healthy (or none runs), else 503 naming each unhealthy loop, and why only to a
        caller who may read the API (the reasons quote errors: workspaces, hosts, stores)."""

        @app.get("/live", include_in_schema=False)
        async def live() -> JSONResponse:
            return JSONResponse({"status": "ok"})

        @app.get("/ready", include_in_schema=False)
        async def ready() -> JSONResponse:
            stuck = self.controllers.stuck() if self.controllers is not None else {}
            if stuck:
                return JSONResponse({"status": "not ready", "reasons": stuck}, status_code=503)
            return JSONResponse({"status": "ready"})

        @app.get("/health/controllers", include_in_schema=False)
        async def controllers(request: Request) -> JSONResponse:
            status, body = 200, {"status": "ok", "unhealthy": {}, "loops": []}
            if self.controllers is not None:
                status, body = readiness(self.controllers)
                if not self._may_read(request):
                    body["unhealthy"] = dict.fromkeys(body["unhealthy"], "unhealthy")
                body["loops"] = sorted(self.controllers.loops)
            if self.retention is not None:  # (its failures are the shared database's: no 503)
                report = self.retention.report()
                if report["error"] and not self._may_read(request):
                    report["error"] = "failed"
                body["usage_retention"] = report
            return JSONResponse(body, status_code=status)

    def _may_read(self, request: Request) -> bool:
        """Whether `request` may read what the API's reads return (the admin token, if any)."""
        token = self.config.admin_token
        if token is None or self.config.public_read:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), token.encode()
        )

    async def stop(self) -> None:
        if self._retention_task is not None:
            self._retention_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retention_task
            self._retention_task = None
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._socket is not None:
            self._socket.close()
        if self.engine is not None:
            await self.engine.dispose()
        self._server = self._task = self._socket = self.engine = None
