"""Leadership of the models controller: one replica works, the others wait, and one takes
over when the leader goes; a replica acts only one TTL after winning, and stops counting
itself leader once its lease was not renewed for a TTL."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest

from shoal.catalog import CatalogServer
from shoal.catalog.controller import ROLE, ModelsController
from shoal.catalog.leader import Leadership, leader_key
from shoal.store import Store, open_store
from tests.catalog.controller_fixtures import FakeBackend, RecordingClient
from tests.helpers import wait_for


@pytest.fixture
async def store() -> AsyncIterator[Store]:
    s = await open_store(f"memory://{uuid.uuid4().hex}")
    yield s
    await s.close()


async def in_force_after_a_ttl(leadership: Leadership) -> None:
    """The winner holds the key at once, and acts one TTL later."""
    assert not await leadership.hold() and leadership.leading
    await wait_for(leadership.hold, timeout=5 * leadership.ttl + 5)


async def test_one_replica_holds_the_key_and_the_other_takes_over_when_it_goes(
    store: Store,
) -> None:
    first, second = Leadership(store, ROLE, ttl=2), Leadership(store, ROLE, ttl=2)
    await in_force_after_a_ttl(first)
    assert not await second.hold() and not second.leading
    assert await first.hold() and not await second.hold()  # held, not re-won
    held = await store.get(leader_key(ROLE))
    assert held is not None and first.lease is not None and held.lease == first.lease.id
    await first.release()
    assert await store.get(leader_key(ROLE)) is None  # gone with the lease
    await in_force_after_a_ttl(second)
    assert not await first.hold()


async def test_a_leader_whose_lease_expired_stops_leading(store: Store) -> None:
    first, second = Leadership(store, ROLE, ttl=2), Leadership(store, ROLE, ttl=2)
    await in_force_after_a_ttl(first)
    assert first.lease is not None
    await store.revoke(first.lease.id)  # as if it expired while the holder was stalled
    await in_force_after_a_ttl(second)
    assert not await first.hold()  # a new lease, but the key is the other's


async def test_a_leader_whose_lease_was_not_renewed_for_a_ttl_is_not_in_force(
    store: Store,
) -> None:
    """No call needed: a frozen or cut-off leader knows from its clock alone."""
    leadership = Leadership(store, ROLE, ttl=2)
    await in_force_after_a_ttl(leadership)
    assert leadership.lease is not None
    leadership.lease.stop_keepalive()  # as if the store stopped answering
    await wait_for(lambda: not leadership.in_force(), timeout=2)
    assert leadership.leading  # the key may still be there: not in force all the same


async def test_a_renewal_answered_after_the_lease_expired_does_not_put_leadership_in_force(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal counted from when its answer came: a replica frozen (or a network slow) for
    a TTL between the store renewing the lease and the answer reaching it took the lease as
    renewed just now, in force for one more TTL of writes, though the store had expired it
    (and another replica may lead). It counts from when it was asked: the store cannot have
    renewed it before."""
    leadership = Leadership(store, ROLE, ttl=1)
    await in_force_after_a_ttl(leadership)
    lease = leadership.lease
    assert lease is not None
    lease.stop_keepalive()
    renew = store._keepalive

    async def answered_late(lease_id: int, ttl: float) -> bool:
        alive = await renew(lease_id, ttl)
        await asyncio.sleep(ttl * 1.2)  # the answer reaches the replica a TTL late
        return alive

    monkeypatch.setattr(store, "_keepalive", answered_late)
    await lease.keepalive()
    assert await store.get(leader_key(ROLE)) is None  # the store expired the lease meanwhile
    assert not leadership.in_force()


async def test_only_the_leading_controller_makes_passes(
    catalog: CatalogServer, store: Store
) -> None:
    controllers: list[ModelsController] = []
    async with aiohttp.ClientSession() as session:
        clients = [RecordingClient(catalog.url) for _ in range(2)]
        for client in clients:
            controllers.append(ModelsController(
                client, store, FakeBackend(), session, workspaces=["team-a"],
                leadership=Leadership(store, ROLE, ttl=2),
            ))  # fmt: skip
        try:
            await controllers[0].step()  # wins the key; acts one TTL later
            assert controllers[0].leadership is not None
            await wait_for(controllers[0].leadership.hold, timeout=10)
            for _ in range(2):
                for controller in controllers:
                    await controller.step()
            assert [c.passes for c in controllers] == [2, 0]
            assert clients[1].calls == []  # a waiting replica does not touch the catalog
            assert controllers[0].leadership is not None
            await controllers[0].leadership.release()
            assert controllers[1].leadership is not None
            await wait_for(controllers[1].leadership.hold, timeout=10)
            await controllers[1].step()
            await controllers[0].step()
            assert [c.passes for c in controllers] == [2, 1]
        finally:
            for client in clients:
                await client.close()
