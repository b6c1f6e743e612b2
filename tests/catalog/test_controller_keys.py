"""The keys phase of the models controller (SQLite and PostgreSQL): each live secret of each
key is published as a grant (hash, allow-list, limits; never the secret), revocations remove
or disable it, and a converged pass writes nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from shoal.catalog import KEYS, CatalogError, CatalogServer
from shoal.catalog.controller import PassError
from shoal.discovery.grants import decode_grant, grant_key, grants_prefix, hash_secret
from tests.catalog.controller_fixtures import WS, controller_on


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
