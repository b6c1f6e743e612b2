"""A deleted key stops working within the controller's interval, whatever else a pass waits
on (SQLite and PostgreSQL): hung providers in other workspaces make a pass long, and the key
must not wait for that pass to end."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import openai

from shoal.catalog import KEYS, PROVIDERS, CatalogServer
from shoal.catalog.controller import ControllerConfig, ModelsControllerService
from shoal.discovery import Discovery
from shoal.discovery.grants import grants_prefix
from shoal.frontend import Frontend, FrontendConfig
from shoal.store import open_store
from tests.catalog.controller_fixtures import RecordingClient, openai_servers
from tests.frontend.support import FakeWorker
from tests.helpers import wait_for

HUNG = 6  # workspaces whose provider never answers: each costs one provider timeout a pass


async def test_a_deleted_key_stops_working_within_the_interval_while_a_pass_waits_on_hung_providers(
    catalog: CatalogServer, tmp_path: Path
) -> None:
    interval = 0.5  # the provider timeout is 1 s (two intervals): a pass takes ~HUNG s
    store_url = f"memory://{uuid.uuid4().hex}"
    store = await open_store(store_url)
    worker = await FakeWorker("chat").start()
    config = ControllerConfig(catalog_url=catalog.url, store_url=store_url, interval=interval,
                              log_dir=tmp_path, leader_ttl=0.5)  # fmt: skip
    service = ModelsControllerService(config)
    frontend = Frontend(
        FrontendConfig(port=0, auth="keys", workspaces=("team-a",), cache_dir=tmp_path / "c"),
        discovery=Discovery(store),
    )
    async with openai_servers(*([[]] * HUNG)) as servers:
        try:
            await worker.register(store)
            for server in servers:
                server.delay = 3600.0  # hung: holds the request, never answers
            clients = []
            for i, server in enumerate(servers):
                client = RecordingClient(catalog.url, workspace=f"ws-{i}")
                clients.append(client)
                await client.create(PROVIDERS, {"name": "p", "type": "url",
                                                "base_url": server.base_url})  # fmt: skip
            team = RecordingClient(catalog.url, workspace="team-a")
            clients.append(team)
            made = await team.create_key("team")
            await service.start()
            await frontend.start()
            await wait_for(lambda: "chat" in frontend.registry.models)
            await wait_for(lambda: frontend.keys is not None and frontend.keys.by_hash, timeout=20)
            async with openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key=made.secret,
                                          max_retries=0) as api:  # fmt: skip
                chat = [{"role": "user", "content": "hi"}]
                await api.chat.completions.create(model="chat", messages=chat)  # type: ignore[arg-type]
                # the keys of this pass are published: its other phases wait on the providers
                asked = sum(s.requests for s in servers)
                await wait_for(lambda: sum(s.requests for s in servers) > asked, timeout=20)
                await team.delete(KEYS, "team")
                deleted = time.monotonic()
                while True:
                    try:
                        await api.chat.completions.create(model="chat", messages=chat)  # type: ignore[arg-type]
                    except openai.AuthenticationError:
                        break
                    assert time.monotonic() - deleted < 30
                took = time.monotonic() - deleted
            assert not (await store.get_prefix(grants_prefix("team-a"))).items
            assert service.controller is not None
            first = service.controller.passes == 0  # (the pass it was deleted in goes on)
            # before: it worked until that pass ended and the next one began (~HUNG s + 0.5)
            assert took < 3 * interval + 1.0, f"revoked after {took:.2f} s (first pass: {first})"
        finally:
            await frontend.stop()
            await service.stop()
            for client in clients:
                await client.close()
            await worker.stop()
            await store.close()
