"""Leadership of the models controller: one replica works, the others wait, and one takes
over when the leader goes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest

from shoal.catalog import CatalogServer
from shoal.catalog.controller import ROLE, ModelsController
from shoal.catalog.leader import Leadership, leader_key
from shoal.store import Store, open_store
from tests.catalog.controller_fixtures import FakeBackend, RecordingClient


@pytest.fixture
async def store() -> AsyncIterator[Store]:
    s = await open_store(f"memory://{uuid.uuid4().hex}")
    yield s
    await s.close()


async def test_one_replica_holds_the_key_and_the_other_takes_over_when_it_goes(
    store: Store,
) -> None:
    first, second = Leadership(store, ROLE, ttl=5), Leadership(store, ROLE, ttl=5)
    assert await first.hold() and not await second.hold()
    assert await first.hold() and not await second.hold()  # held, not re-won
    held = await store.get(leader_key(ROLE))
    assert held is not None and first.lease is not None and held.lease == first.lease.id
    await first.release()
    assert await store.get(leader_key(ROLE)) is None  # gone with the lease
    assert await second.hold() and not await first.hold()


async def test_a_leader_whose_lease_expired_stops_leading(store: Store) -> None:
    first, second = Leadership(store, ROLE, ttl=5), Leadership(store, ROLE, ttl=5)
    assert await first.hold()
    assert first.lease is not None
    await store.revoke(first.lease.id)  # as if it expired while the holder was stalled
    assert await second.hold()
    assert not await first.hold()  # a new lease, but the key is the other's


async def test_only_the_leading_controller_makes_passes(
    catalog: CatalogServer, store: Store
) -> None:
    controllers: list[ModelsController] = []
    async with aiohttp.ClientSession() as session:
        clients = [RecordingClient(catalog.url) for _ in range(2)]
        for client in clients:
            controllers.append(ModelsController(
                client, store, FakeBackend(), session, workspaces=["team-a"],
                leadership=Leadership(store, ROLE, ttl=5),
            ))  # fmt: skip
        try:
            for _ in range(2):
                for controller in controllers:
                    await controller.step()
            assert [c.passes for c in controllers] == [2, 0]
            assert clients[1].calls == []  # a waiting replica does not touch the catalog
            assert controllers[0].leadership is not None
            await controllers[0].leadership.release()
            await controllers[1].step()
            await controllers[0].step()
            assert [c.passes for c in controllers] == [2, 1]
        finally:
            for client in clients:
                await client.close()
