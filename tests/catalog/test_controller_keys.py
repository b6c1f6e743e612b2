"""The keys phase of the models controller (SQLite and PostgreSQL): each live secret of each
key is published as a grant (hash, allow-list, limits; never the secret), revocations remove
or disable it, and a converged pass writes nothing."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest

from shoal.catalog import KEYS, PROVIDERS, CatalogError, CatalogServer, routing
from shoal.catalog.calls import WRITES_AT_ONCE
from shoal.catalog.controller import PassError
from shoal.catalog.grants import KeysResult
from shoal.catalog.leader import Leadership, LeadershipLost
from shoal.catalog.routing import SLICE
from shoal.discovery import route_key
from shoal.discovery.grants import decode_grant, grant_key, grants_prefix, hash_secret
from tests.catalog.controller_fixtures import WS, controller_on, openai_servers, seed_converged
from tests.helpers import wait_for


async def test_each_live_secret_is_published_as_a_grant_and_never_the_secret(
    catalog: CatalogServer,
) -> None:
    async with controller_on(catalog.url) as (ctl, client, store):
        made = await client.create_key("team-x", {"models": ["chat"], "rpm": 10, "tpm": 99})
        other = await client.create_key("team-y")
        await ctl.step()
        held = (await store.get_prefix(grants_prefix(WS))).items
        assert len(held) == 2 and ctl.last is not None and ctl.last.grants_written == 2
        assert all(made.secret.encode() not in kv.value for kv in held)
        x = next(kv for kv in held if b"team-x" in kv.value)
        grant = decode_grant(x.key, x.value)
        assert (grant.hash, grant.models, grant.rpm, grant.tpm, grant.disabled) == (
            hash_secret(made.secret), ("chat",), 10, 99, False,
        )  # fmt: skip
        await ctl.step()  # converged: nothing written
        assert ctl.last.grants_written == ctl.last.grants_deleted == 0

        await client.update(KEYS, "team-x", {"disabled": True})
        rotated = await client.rotate_key("team-y")  # the old secret ends at once
        await ctl.step()
        assert (ctl.last.grants_written, ctl.last.grants_deleted) == (2, 1)
        disabled = await store.get(grant_key(WS, hash_secret(made.secret)))
        assert disabled is not None and decode_grant(disabled.key, disabled.value).disabled
        assert await store.get(grant_key(WS, hash_secret(other.secret))) is None
        assert await store.get(grant_key(WS, hash_secret(rotated.secret))) is not None

        await client.delete(KEYS, "team-x")
        await ctl.step()
        assert [decode_grant(kv.key, kv.value).name for kv in
                (await store.get_prefix(grants_prefix(WS))).items] == ["team-y"]  # fmt: skip


async def test_a_rotated_secret_keeps_working_until_its_end(catalog: CatalogServer) -> None:
    async with controller_on(catalog.url) as (ctl, client, store):
        first = await client.create_key("k", {"expires_at": "2099-01-01T00:00:00Z"})
        until = datetime.now(UTC) + timedelta(hours=1)
        second = await client.rotate_key("k", old_valid_until=until.isoformat())
        await ctl.step()
        old = await store.get(grant_key(WS, hash_secret(first.secret)))
        new = await store.get(grant_key(WS, hash_secret(second.secret)))
        assert old is not None and new is not None
        assert abs(decode_grant(old.key, old.value).expires_at - until.timestamp()) < 1  # type: ignore[operator]
        assert (
            decode_grant(new.key, new.value).expires_at
            == datetime(2099, 1, 1, tzinfo=UTC).timestamp()
        )


async def test_keys_are_published_even_when_an_earlier_phase_fails(
    catalog: CatalogServer,
) -> None:
    async with controller_on(catalog.url) as (ctl, client, store):
        made = await client.create_key("k")

        async def broken(workspace: str) -> None:
            raise CatalogError("the providers phase failed")

        ctl.providers.run = broken  # type: ignore[assignment,method-assign]
        with pytest.raises(PassError, match="providers phase failed"):
            await ctl.step()
        assert await store.get(grant_key(WS, hash_secret(made.secret))) is not None


async def test_a_key_row_the_client_cannot_read_keeps_its_grants(
    catalog: CatalogServer, database_url: str
) -> None:
    """A key row over today's bounds (1,001 models, as an older catalog let in) is left out
    of the listing; its grants were then deleted as if the key were gone, revoking it on
    every frontend. Now they stay, and the key is named in keys_failed."""
    import sqlalchemy as sa

    from shoal.catalog.database import open_engine
    from shoal.catalog.tables import keys as keys_table

    async with controller_on(catalog.url) as (ctl, client, store):
        made = await client.create_key("k", {"models": ["m"]})
        await client.create_key("other")
        await ctl.step()
        held = {kv.key for kv in (await store.get_prefix(grants_prefix(WS))).items}
        assert grant_key(WS, hash_secret(made.secret)) in held and len(held) == 2
        engine = open_engine(database_url)
        try:
            async with engine.begin() as conn:
                row = (
                    await conn.execute(sa.select(keys_table).where(keys_table.c.name == "k"))
                ).one()
                data = {**row.data, "models": [f"m{i}" for i in range(1001)]}
                await conn.execute(
                    keys_table.update().where(keys_table.c.id == row.id).values(data=data)
                )
        finally:
            await engine.dispose()
        await client.delete(KEYS, "other")
        await ctl.step()
        after = {kv.key for kv in (await store.get_prefix(grants_prefix(WS))).items}
        assert after == {grant_key(WS, hash_secret(made.secret))}  # other's went, k's stayed
        assert ctl.last is not None and f"{WS}/k" in ctl.last.keys_failed


async def test_every_workspaces_keys_are_published_before_any_other_phase(
    catalog: CatalogServer,
) -> None:
    """Each workspace's keys waited behind the phases of every workspace before it (a revoked
    key kept working ~47 s at 1,001 workspaces): a pass publishes every workspace's keys
    first, then runs the other phases, each workspace on its own still."""
    names = ["ws-a", "ws-b", "ws-c"]
    async with controller_on(catalog.url, workspaces=names) as (ctl, client, store):
        for workspace in names:
            await client.create_key("team", workspace=workspace)
        order: list[tuple[str, str]] = []
        keys_run, deployments_run = ctl.keys.run, ctl.deployments.run

        async def keys(workspace: str, *rest: Any) -> KeysResult:
            order.append(("keys", workspace))
            return await keys_run(workspace, *rest)

        async def deployments(workspace: str) -> None:
            order.append(("deployments", workspace))
            if workspace == "ws-b":
                raise CatalogError("the deployments phase failed")
            await deployments_run(workspace)

        ctl.keys.run = keys  # type: ignore[method-assign]
        ctl.deployments.run = deployments  # type: ignore[method-assign]
        await ctl.step()
        assert order == [("keys", w) for w in names] + [("deployments", w) for w in names]
        for workspace in names:
            assert len((await store.get_prefix(grants_prefix(workspace))).items) == 1
        assert ctl.last is not None and list(ctl.last.failed) == ["ws-b"]  # its own only


async def test_a_replica_whose_leadership_lapsed_mid_pass_publishes_nothing_more(
    catalog: CatalogServer,
) -> None:
    """Leadership was checked only when a pass began: a replica whose lease lapsed while it
    listed a workspace's keys went on publishing grants, routes and catalog writes from its
    listings while another replica led. It is checked before each workspace's phases and
    before grants and routes are written: the pass stops with `LeadershipLost`."""
    async with controller_on(catalog.url, workspaces=["ws-a", "ws-b"]) as (ctl, client, store):
        for workspace in ("ws-a", "ws-b"):
            await client.create_key("team", workspace=workspace)
        leadership = ctl.leadership = Leadership(store, "models-controller", ttl=0.2)
        await wait_for(leadership.hold)
        other = Leadership(store, "models-controller", ttl=0.2)

        async def lapse(call: str, params: Any) -> None:
            if call == "GET /v1/workspaces/ws-a/keys" and leadership.in_force():
                assert leadership.lease is not None
                await leadership.lease.revoke()  # its lease ends; another replica leads
                await wait_for(other.hold)

        client.before = lapse
        phases: list[str] = []
        deployments_run = ctl.deployments.run

        async def deployments(workspace: str) -> None:
            phases.append(workspace)
            await deployments_run(workspace)

        ctl.deployments.run = deployments  # type: ignore[method-assign]
        with pytest.raises(LeadershipLost):
            await ctl.step()
        for workspace in ("ws-a", "ws-b"):
            assert (await store.get_prefix(grants_prefix(workspace))).items == []
        assert phases == []


async def test_the_keys_phase_turns_the_loop_every_slice_of_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """10,000 keys were turned into grants, and their grants compared with the store's, in
    one hold of the event loop (~50 ms): the phase yields, and beats the controller's
    heartbeat, every `SLICE` keys and grants, a converged pass too."""
    import hashlib
    import uuid

    from shoal.catalog import grants as grants_module
    from shoal.catalog.calls import Listing
    from shoal.catalog.grants import KeysPhase
    from shoal.catalog.resources import Key
    from shoal.catalog.routing import SLICE
    from shoal.discovery.grants import Grant
    from shoal.store import open_store
    from tests.catalog.test_routing import ticker

    now = datetime.now(UTC).isoformat()
    n = 3 * SLICE + 1
    keys = Listing(
        Key.model_validate({
            "name": f"k{i:05d}", "workspace": WS, "version": 1, "created_at": now,
            "updated_at": now, "credentials": [
                {"hash": hashlib.sha256(b"%d" % i).hexdigest(), "created_at": now}
            ],
        })
        for i in range(n)
    )  # fmt: skip
    beats: list[int] = []

    class Calls:
        def beat(self) -> None:
            beats.append(1)

        async def list_all(self, kind: Any, workspace: str) -> Listing[Key]:
            return keys

    store = await open_store(f"memory://{uuid.uuid4().hex}")
    try:
        phase = KeysPhase(Calls(), store)  # type: ignore[arg-type]
        assert (await phase.run(WS)).written == n
        async with ticker() as ticks:
            made: list[int] = []
            compared: list[int] = []
            real_grants_of, real_to_json = grants_module.grants_of, Grant.to_json

            def grants_of(key: Key, at: datetime) -> list[Grant]:
                made.append(ticks[0])
                return real_grants_of(key, at)

            def to_json(grant: Grant) -> bytes:
                compared.append(ticks[0])
                return real_to_json(grant)

            monkeypatch.setattr(grants_module, "grants_of", grants_of)
            monkeypatch.setattr(Grant, "to_json", to_json)
            beats.clear()
            converged = await phase.run(WS)
        assert converged.written == converged.deleted == 0
        assert len(made) == len(compared) == n
        for turns in (made, compared):
            assert max(turns.count(tick) for tick in set(turns)) <= SLICE
        assert len(beats) >= 6
    finally:
        await store.close()


async def test_a_replica_whose_leadership_lapses_while_it_publishes_routes_stops_at_once(
    catalog: CatalogServer, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leadership was checked once before a workspace's routes were published: a replica
    whose lease lapsed after its first route went on writing the other 2,000 (and deleting
    routes, each after a catalog read) while another replica led; at 1-5 ms a write on etcd,
    10,000 routes outlast a TTL. Then it was checked every `SLICE` routes: a replica frozen
    (SIGSTOP, a VM pause) mid-slice for longer than two TTLs still wrote up to 499 routes of
    its old listing over the new leader's when it ran again. It is checked (a clock read)
    before each write and each delete: nothing is written once it lapsed."""
    await seed_converged(database_url, {"p": [f"m{i:04d}" for i in range(4 * SLICE + 1)]})
    async with controller_on(catalog.url, workspaces=[WS]) as (ctl, _, store):
        await store.put(route_key(WS, "gone-vm"), b"{}")  # a route whose model was deleted
        # (a TTL that a loaded machine's pass and renewals keep within: at 2 s, with the
        # suite beside four other jobs on 2 cores, it lapsed before the first write)
        leadership = ctl.leadership = Leadership(store, "models-controller", ttl=5.0)
        await wait_for(leadership.hold, timeout=30)
        written: list[bool] = []  # whether each route was written while in force
        real_publish = routing.publish_route

        async def publish_route(to: Any, route: Any) -> bool:
            written.append(leadership.in_force())
            if len(written) == 10:
                assert leadership.lease is not None
                await leadership.lease.revoke()  # its lease ends; another replica may lead
            return await real_publish(to, route)

        monkeypatch.setattr(routing, "publish_route", publish_route)
        with pytest.raises(LeadershipLost):
            await ctl.step()
        assert written == [True] * 10, written  # (the 10th was checked before its lease went)
        assert await store.get(route_key(WS, "gone-vm")) is not None  # nor deleted


async def test_a_replica_whose_leadership_lapses_while_it_publishes_grants_stops_at_once(
    catalog: CatalogServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grants were written and deleted a slice (500) between two checks of the leadership: a
    replica that lapsed mid-slice (frozen past two TTLs) put back grants of keys the new
    leader had revoked, and deleted grants it had published. Each write and delete is checked
    now: none follows the lapse."""
    async with controller_on(catalog.url, workspaces=[WS]) as (ctl, client, store):
        for i in range(30):
            await client.create_key(f"k{i:02d}")
        await store.put(grant_key(WS, "0" * 64), b"{}")  # a grant of no key: to be deleted
        leadership = ctl.leadership = Leadership(store, "models-controller", ttl=5.0)
        await wait_for(leadership.hold, timeout=30)
        written: list[bool] = []
        real_put = store.put

        async def put(key: str, value: bytes, **kwargs: Any) -> Any:
            written.append(leadership.in_force())
            if len(written) == 10:
                assert leadership.lease is not None
                await leadership.lease.revoke()  # its lease ends; another replica may lead
            return await real_put(key, value, **kwargs)

        monkeypatch.setattr(store, "put", put)
        with pytest.raises(LeadershipLost):
            await ctl.step()
        assert written == [True] * 10, written
        assert await store.get(grant_key(WS, "0" * 64)) is not None  # nor deleted


async def test_a_replica_whose_leadership_lapses_while_it_writes_the_catalog_stops_at_once(
    catalog: CatalogServer,
) -> None:
    """The providers phase's catalog writes (entities, passthrough virtual models, statuses,
    deletes of those nobody serves) were checked for leadership only before the phase: a
    replica that lapsed mid-phase (frozen past two TTLs) went on creating and deleting from
    its old listing while another led. Each catalog write is checked now: none follows."""
    async with (
        openai_servers([f"m{i:03d}" for i in range(60)]) as [server],
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, store),
    ):
        await client.create(PROVIDERS, {"name": "p", "type": "url", "base_url": server.base_url})
        leadership = ctl.leadership = Leadership(store, "models-controller", ttl=5.0)
        await wait_for(leadership.hold, timeout=30)
        written: list[bool] = []

        async def before(call: str, params: Any) -> None:
            if call.startswith("GET "):
                return
            written.append(leadership.in_force())
            if len(written) == 10:
                assert leadership.lease is not None
                await leadership.lease.revoke()  # its lease ends; another replica may lead

        client.before = before
        with pytest.raises(LeadershipLost):
            await ctl.step()
        # (besides the 10th, only writes checked before it lapsed, already on their way)
        assert written[:10] == [True] * 10 and len(written) < 10 + WRITES_AT_ONCE, written


async def test_a_key_with_an_expiry_without_offset_is_still_revoked_after_a_graced_rotation(
    catalog: CatalogServer,
) -> None:
    """An `expires_at` written without an offset is UTC: beside a rotated secret's end (with
    an offset) it once made the key's grants impossible to compute (naive vs aware), so the
    key's grants were kept as they were, and disabling it never reached the frontends."""
    async with controller_on(catalog.url) as (ctl, client, store):
        first = await client.create_key("k", {"expires_at": "2099-01-01T00:00:00"})
        until = datetime.now(UTC) + timedelta(hours=1)
        second = await client.rotate_key("k", old_valid_until=until.isoformat())
        await client.update(KEYS, "k", {"disabled": True})
        await ctl.step()
        assert ctl.last is not None and ctl.last.keys_failed == {}
        for secret in (first.secret, second.secret):
            held = await store.get(grant_key(WS, hash_secret(secret)))
            assert held is not None
            grant = decode_grant(held.key, held.value)
            assert grant.disabled
        new = decode_grant(held.key, held.value)
        assert new.expires_at == datetime(2099, 1, 1, tzinfo=UTC).timestamp()


def _key_body_at_the_bound(name: str) -> bytes:
    """A key create body of exactly `MAX_BODY_BYTES` (4-byte characters, written raw), whose
    grant is ~270 bytes larger (the workspace, the hash, the limits), over the store's bound."""
    from shoal.catalog.api import MAX_BODY_BYTES

    item = "\U0001f600" * 400
    models = [item] * ((MAX_BODY_BYTES - 2000) // (len(item.encode()) + 3))

    def encoded() -> bytes:
        body = {"name": name, "rpm": 10**12, "tpm": 10**12, "max_parallel": 10**12,
                "expires_at": "2099-01-01T00:00:00Z", "models": models}  # fmt: skip
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()

    models.append("x" * 400)
    while len(encoded()) + 403 <= MAX_BODY_BYTES:
        models.append("x" * 400)
    models.append("x" * (MAX_BODY_BYTES - len(encoded()) - 3))
    assert len(encoded()) == MAX_BODY_BYTES
    return encoded()


async def test_a_key_whose_models_would_not_fit_a_grant_is_422(catalog: CatalogServer) -> None:
    """The API took a key whose grant the store then refused (a body at the 1 MiB bound, its
    models in 4-byte characters): a key that could never be used. Its `models` are bounded
    in bytes now (`KEY_MODELS_BYTES`), well within a grant."""
    async with aiohttp.ClientSession() as session:
        url = f"{catalog.url}/v1/workspaces/{WS}/keys"
        headers = {"Content-Type": "application/json"}
        body = _key_body_at_the_bound("a-big")
        async with session.post(url, data=body, headers=headers) as resp:
            answer = await resp.json()
            assert resp.status == 422, answer
        assert answer["error"]["param"] == "models", answer
        async with session.get(f"{catalog.url}/v1/workspaces/{WS}/keys/a-big") as resp:
            assert resp.status == 404


async def test_a_grant_the_store_refuses_fails_only_its_key(
    catalog: CatalogServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key whose grant the store refuses (over its 1 MiB value bound: as the API let in
    before `KEY_MODELS_BYTES`, lifted here) stopped the keys phase of its workspace at that
    write: the other keys were not published, and the grants of keys deleted meanwhile were
    never deleted (a revoked key kept working). Now it is that key's failure, named in
    `keys_failed`, and the others are published and revoked."""
    from shoal.catalog import resources

    monkeypatch.setattr(resources, "KEY_MODELS_BYTES", 2 << 20, raising=False)
    async with controller_on(catalog.url) as (ctl, client, store):
        async with aiohttp.ClientSession() as session:
            url = f"{catalog.url}/v1/workspaces/{WS}/keys"
            headers = {"Content-Type": "application/json"}
            body = _key_body_at_the_bound("a-big")
            async with session.post(url, data=body, headers=headers) as resp:
                assert resp.status == 201, await resp.text()
        small = await client.create_key("z-small")
        revoked = await client.create_key("m-revoked")
        await ctl.step()
        assert ctl.last is not None and list(ctl.last.keys_failed) == [f"{WS}/a-big"]
        assert "byte" in ctl.last.keys_failed[f"{WS}/a-big"]
        assert ctl.last.failed == {}
        assert await store.get(grant_key(WS, hash_secret(small.secret))) is not None
        assert await store.get(grant_key(WS, hash_secret(revoked.secret))) is not None
        await client.delete(KEYS, "m-revoked")
        await ctl.step()
        assert await store.get(grant_key(WS, hash_secret(revoked.secret))) is None
        assert await store.get(grant_key(WS, hash_secret(small.secret))) is not None
