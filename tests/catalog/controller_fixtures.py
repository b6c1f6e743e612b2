"""What the models-controller tests share: a recording client, fake OpenAI servers, a fake
deployment backend, and a controller on a real catalog API and an in-memory store."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlparse

import aiohttp
import sqlalchemy as sa
from aiohttp import web

from shoal.cards import ModelCard, slugify
from shoal.catalog import MODELS, PROVIDERS, VIRTUAL_MODELS, CatalogClient, CatalogError, Kind
from shoal.catalog.backends import Backend, DeploymentId, Observed
from shoal.catalog.controller import ModelsController
from shoal.catalog.database import open_engine
from shoal.catalog.resources import Deployment
from shoal.catalog.tables import workspaces
from shoal.discovery import Discovery, EndpointId, InstanceInfo, ModelKey
from shoal.store import Store, open_store
from tests.helpers import Server

WS = "team-a"


class RecordingClient(CatalogClient):
    """Counts like the real client, and records each call as `METHOD /path`; `fail` and
    `hold` pick calls to refuse (a 500-like `CatalogError`) or to keep waiting forever."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self.fail: Callable[[str], bool] = lambda call: False
        self.hold: Callable[[str], bool] = lambda call: False
        self.held = asyncio.Event()
        self.before: Callable[[str, Any], Awaitable[None]] | None = None  # (call, params)

    async def _call(self, method: str, url: str, **kwargs: Any) -> Any:
        call = f"{method} {urlparse(url).path}"
        self.calls.append(call)
        if self.before is not None:
            await self.before(call, kwargs.get("params"))
        if self.fail(call):
            self.requests += 1
            error = CatalogError(f"{call} failed (test)")
            error.status = 500
            raise error
        if self.hold(call):
            self.requests += 1
            self.held.set()
            await asyncio.Event().wait()
        return await super()._call(method, url, **kwargs)

    def made(self, prefix: str) -> int:
        return sum(1 for call in self.calls if call.startswith(prefix))


class OpenAIServer:
    """`GET /v1/models` listing `names`; `status` other than 200 answers that instead;
    `before` runs before each answer (to change the catalog mid-pass)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.status = 200
        self.before: Callable[[], Awaitable[None]] | None = None
        self.delay = 0.0
        self.requests = 0
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        self.server = Server(app)

    @property
    def base_url(self) -> str:
        return f"{self.server.url}/v1"

    async def _models(self, request: web.Request) -> web.Response:
        self.requests += 1
        if self.before is not None:
            await self.before()
        if self.delay:
            await asyncio.sleep(self.delay)  # a slow upstream, not synchronisation
        if self.status != 200:
            return web.json_response({"error": {"message": "down"}}, status=self.status)
        data = [{"id": name, "object": "model", "owned_by": "test"} for name in self.names]
        return web.json_response({"object": "list", "data": data})


@asynccontextmanager
async def openai_servers(*names_each: list[str]) -> AsyncIterator[list[OpenAIServer]]:
    servers = [OpenAIServer(names) for names in names_each]
    for server in servers:
        await server.server.start()
    try:
        yield servers
    finally:
        for server in servers:
            await server.server.stop()


class FakeBackend(Backend):
    """A backend whose replicas are all ready at once (a mock of the one piece), recording
    what it was asked."""

    def __init__(self) -> None:
        self.runs: set[DeploymentId] = set()
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.failing: set[str] = set()

    async def start(self, deployment: Deployment) -> None:
        self.runs.add((deployment.workspace, deployment.name))
        self.started.append(deployment.name)

    async def poll(self, deployment: Deployment) -> Observed:
        self.runs.add((deployment.workspace, deployment.name))
        if deployment.name in self.failing:
            return Observed(0, deployment.replicas, True, "replicas keep failing (test)")
        return Observed(deployment.replicas, deployment.replicas, False, "all ready")

    async def stop(self, workspace: str, name: str) -> None:
        if (workspace, name) in self.runs:
            self.runs.discard((workspace, name))
            self.stopped.append(name)

    def running(self) -> set[DeploymentId]:
        return set(self.runs)


def card(name: str) -> ModelCard:
    return ModelCard.build(
        display_name=name,
        slug=slugify(name),
        source=f"hf://{name}",
        model_types=["chat"],
        context_length=4096,
    )


async def announce(store: Store, namespace: str, name: str, instance_id: int) -> None:
    """A worker's registration of `name` in `namespace` (no process: the keys only)."""
    endpoint = EndpointId(namespace, "backend", "generate")
    discovery = Discovery(store)
    await discovery.register_instance(
        InstanceInfo(namespace, "backend", "generate", instance_id,
                     f"http://127.0.0.1:1/{instance_id}", f"http://127.0.0.1:1/s{instance_id}"),
        lease=0,
    )  # fmt: skip
    await discovery.register_model(ModelKey(endpoint, instance_id), card(name), lease=0)


async def seed_converged(database_url: str, served: dict[str, list[str]]) -> None:
    """Rows as a converged controller leaves them for url providers `served` (name → model
    names), inserted in bulk: a test of the steady state need not pay for the cold pass."""
    engine = open_engine(database_url)
    now = datetime.now(UTC)
    rows: dict[Kind[Any], list[dict[str, Any]]] = {PROVIDERS: [], MODELS: [], VIRTUAL_MODELS: []}
    bodies: dict[Kind[Any], list[dict[str, Any]]] = {k: [] for k in rows}
    for provider, names in served.items():
        ref = f"{WS}/{provider}"
        bodies[PROVIDERS].append({
            "name": provider, "type": "url", "base_url": "http://127.0.0.1:1/v1",
            "status": "READY", "status_message": f"{len(names)} model(s)",
            "served_models": [{"model_entity": n, "served_model_name": n} for n in names],
        })  # fmt: skip
        for name in names:
            bodies[MODELS].append({"name": name, "autoprovisioned": True,
                                   "description": f"served by {ref}", "providers": [ref]})  # fmt: skip
            bodies[VIRTUAL_MODELS].append({"name": name, "default_model": name,
                "autoprovisioned": True,
                "description": "passthrough: the model under its own name"})  # fmt: skip
    for kind, items in bodies.items():
        for body in items:
            made = kind.create.model_validate(body)
            rows[kind].append({"workspace": WS, "name": body["name"], "version": 1,
                "created_at": now, "updated_at": now,
                "data": made.model_dump(mode="json", exclude={"name"})})  # fmt: skip
    try:
        async with engine.begin() as conn:
            await conn.execute(workspaces.insert().values(name=WS, version=1, created_at=now))
            for kind, kind_rows in rows.items():
                await conn.execute(kind.table.insert(), kind_rows)
    finally:
        await engine.dispose()


async def insert_rows(
    database_url: str, kind: Kind[Any], workspace: str, bodies: list[dict[str, Any]]
) -> None:
    """Rows written straight into the database, unvalidated: what an older catalog (before
    a bound) or a hand-made migration may have left, whatever the API accepts today."""
    engine = open_engine(database_url)
    now = datetime.now(UTC)
    rows = [{"workspace": workspace, "name": body["name"], "version": 1, "created_at": now,
             "updated_at": now, "data": {k: v for k, v in body.items() if k != "name"}}
            for body in bodies]  # fmt: skip
    try:
        async with engine.begin() as conn:
            ensure = sa.select(workspaces.c.name).where(workspaces.c.name == workspace)
            if (await conn.execute(ensure)).first() is None:
                await conn.execute(
                    workspaces.insert().values(name=workspace, version=1, created_at=now)
                )
            if rows:
                await conn.execute(kind.table.insert(), rows)
    finally:
        await engine.dispose()


@asynccontextmanager
async def controller_on(
    url: str,
    *,
    workspaces: list[str] | None = None,
    backend: Backend | None = None,
    provider_timeout: float = 10.0,
) -> AsyncIterator[tuple[ModelsController, RecordingClient, Store]]:
    """A controller of the catalog at `url` on a fresh in-memory store."""
    store = await open_store(f"memory://{uuid.uuid4().hex}")
    client = RecordingClient(url, workspace=WS)
    session = aiohttp.ClientSession()
    controller = ModelsController(
        client, store, backend or FakeBackend(), session, workspaces=workspaces,
        deployment_ttl=3600.0, provider_timeout=provider_timeout,
    )  # fmt: skip
    try:
        yield controller, client, store
    finally:
        await session.close()
        await client.close()
        await store.close()
