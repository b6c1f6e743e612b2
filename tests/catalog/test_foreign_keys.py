"""The models controller's phases in a store prefix that holds a key no shoal store may
write or delete (another writer's: etcd takes keys up to 1.5 MiB, shoal's stores refuse
keys over `MAX_KEY_BYTES`): the key is reported and left, and the phase still deletes the
stale grants and routes after it."""

from __future__ import annotations

import uuid
from typing import Any

import aetcd
import pytest

from shoal.catalog.calls import Listing
from shoal.catalog.grants import KeysPhase
from shoal.catalog.resources import Key
from shoal.catalog.routing import publish
from shoal.discovery import Route, UrlTarget, publish_route, route_key
from shoal.discovery.grants import grants_prefix
from shoal.discovery.routes import ROUTES
from shoal.store import MAX_KEY_BYTES, open_store
from tests.etcd_server import EtcdServer

pytestmark = pytest.mark.etcd

FOREIGN = "0" * (MAX_KEY_BYTES + 10)  # (sorts before any hash prefix or route name here)


async def test_a_foreign_key_in_the_grants_prefix_does_not_keep_stale_grants_published(
    etcd_server: EtcdServer,
) -> None:
    """A revoked key's grant must go: the phase raised at the foreign key (sorted first)
    every pass, and the grants after it stayed published, their keys still accepted."""
    workspace = f"ws{uuid.uuid4().hex[:8]}"
    now = "2026-01-01T00:00:00Z"
    listed: list[Any] = [Key.model_validate({
        "name": "team-x", "workspace": workspace, "version": 1, "created_at": now,
        "updated_at": now, "credentials": [{"hash": "ab" * 32, "created_at": now}],
    })]  # fmt: skip

    class Calls:
        def beat(self) -> None:
            pass

        async def list_all(self, kind: Any, workspace: str) -> Listing[Key]:
            return Listing(listed)

    store = await open_store(etcd_server.url)
    client = aetcd.Client(host="127.0.0.1", port=etcd_server.client_port, timeout=5)
    await client.connect()
    foreign = grants_prefix(workspace) + FOREIGN
    try:
        phase = KeysPhase(Calls(), store)  # type: ignore[arg-type]
        assert (await phase.run(workspace)).written == 1
        await client.put(foreign.encode(), b"{}")
        listed.clear()  # (team-x deleted: its grant is stale)
        result = await phase.run(workspace)
        left = [kv.key for kv in (await store.get_prefix(grants_prefix(workspace))).items]
        assert left == [foreign]
        assert result.deleted == 1 and len(result.failed) == 1
        assert all(len(k) + len(v) < 600 for k, v in result.failed.items()), result.failed
    finally:
        await client.delete(foreign.encode())
        await store.close()
        await client.close()


async def test_a_foreign_key_in_the_routes_prefix_does_not_keep_stale_routes_published(
    etcd_server: EtcdServer,
) -> None:
    workspace = f"ws{uuid.uuid4().hex[:8]}"
    store = await open_store(etcd_server.url)
    client = aetcd.Client(host="127.0.0.1", port=etcd_server.client_port, timeout=5)
    await client.connect()
    foreign = f"{ROUTES}{workspace}/" + FOREIGN
    try:
        stale = Route(workspace, "gone", (UrlTarget("https://example.com/v1", "m"),))
        await publish_route(store, stale)
        await client.put(foreign.encode(), b"{}")

        async def gone(name: str) -> bool:
            return True

        done = await publish(store, workspace, [], gone)
        left = [kv.key for kv in (await store.get_prefix(f"{ROUTES}{workspace}/")).items]
        assert left == [foreign]
        assert route_key(workspace, "gone") not in left
        assert done.deleted == 1 and len(done.failed) == 1
        assert all(len(k) + len(v) < 600 for k, v in done.failed.items()), done.failed
    finally:
        await client.delete(foreign.encode())
        await store.close()
        await client.close()
