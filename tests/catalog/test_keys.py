"""API keys in the catalog, on SQLite and PostgreSQL: the secret is shown once and only its
peppered hash is kept; rotation ends the old secrets when asked; apply never touches them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest

from shoal.catalog import KEYS, CatalogClient, CatalogConfig, CatalogServer, InvalidError
from shoal.discovery.grants import hash_secret
from tests.catalog.test_cli import catalog_cli


async def test_create_shows_the_secret_once_and_keeps_only_its_hash(
    client: CatalogClient,
) -> None:
    made = await client.create_key("team-x", {"models": ["chat"], "rpm": 10, "tpm": 1000})
    assert made.secret.startswith("sk-shoal-") and len(made.secret) == len("sk-shoal-") + 43
    assert [c.hash for c in made.credentials] == [hash_secret(made.secret)]
    got = await client.get(KEYS, "team-x")
    assert (got.models, got.rpm, got.tpm, got.version) == (["chat"], 10, 1000, 1)
    assert got.credentials == made.credentials
    async with aiohttp.ClientSession() as session:
        for url in (f"{client.base_url}/v1/workspaces/team-a/keys",
                    f"{client.base_url}/v1/workspaces/team-a/keys/team-x"):  # fmt: skip
            async with session.get(url) as resp:
                assert resp.status == 200 and made.secret not in await resp.text()


async def test_secrets_are_hashed_with_the_server_pepper(database_url: str) -> None:
    server = CatalogServer(CatalogConfig(database_url, port=0, key_pepper="pepper-1"))
    await server.start()
    try:
        async with CatalogClient(server.url) as catalog:
            made = await catalog.create_key("k")
        assert made.credentials[0].hash == hash_secret(made.secret, "pepper-1")
        assert made.credentials[0].hash != hash_secret(made.secret)
    finally:
        await server.stop()


async def test_rotate_gives_a_new_secret_and_ends_the_old_when_asked(
    client: CatalogClient,
) -> None:
    first = await client.create_key("k")
    later = datetime.now(UTC) + timedelta(hours=1)
    second = await client.rotate_key("k", old_valid_until=later.isoformat())
    assert second.secret != first.secret and second.version == 2
    old, new = second.credentials
    assert old.hash == hash_secret(first.secret) and new.hash == hash_secret(second.secret)
    assert old.expires_at is not None and abs((old.expires_at - later).total_seconds()) < 1
    assert new.expires_at is None
    third = await client.rotate_key("k")  # default: the current secrets end at once
    assert [c.hash for c in third.credentials] == [hash_secret(third.secret)]


async def test_patch_and_disable_keep_the_secrets(client: CatalogClient) -> None:
    made = await client.create_key("k", {"rpm": 5})
    got = await client.update(KEYS, "k", {"disabled": True, "rpm": 7}, version=1)
    assert (got.disabled, got.rpm, got.version) == (True, 7, 2)
    assert got.credentials == made.credentials
    assert (await client.get(KEYS, "k")).credentials == made.credentials
    with pytest.raises(InvalidError) as caught:
        await client.update(KEYS, "k", {"credentials": []})
    assert caught.value.param == "credentials"
    with pytest.raises(InvalidError) as caught:
        await client.create_key("bad", {"rpm": 0})
    assert caught.value.param == "rpm"


async def test_apply_manages_keys_without_touching_their_secrets(
    catalog: CatalogServer, client: CatalogClient, tmp_path: Path
) -> None:
    made = await client.create_key("kept", workspace="team-a")
    file = tmp_path / "keys.yaml"
    file.write_text("kind: Key\nname: kept\nmodels: [chat]\nrpm: 60\n---\nkind: Key\nname: fresh\n")
    url = ["--url", catalog.url, "-w", "team-a"]
    code, out, err = await catalog_cli("apply", "-f", str(file), *url)
    assert code == 0, err
    assert sorted(out.split("\n")[:2]) == ["key team-a/fresh created", "key team-a/kept updated"]
    assert "sk-shoal-" not in out + err
    kept = await client.get(KEYS, "kept")
    assert (kept.models, kept.rpm, kept.credentials) == (["chat"], 60, made.credentials)
    code, out, err = await catalog_cli("apply", "-f", str(file), *url)
    assert code == 0, err
    assert sorted(out.splitlines()) == ["key team-a/fresh unchanged", "key team-a/kept unchanged"]


async def test_key_create_and_rotate_print_the_secret(
    catalog: CatalogServer, client: CatalogClient
) -> None:
    url = ["--url", catalog.url, "-w", "team-a"]
    code, out, err = await catalog_cli(
        "key", "create", "cli", "--models", "a,b", "--rpm", "3", *url
    )
    assert code == 0, err
    secret = out.splitlines()[-1]
    got = await client.get(KEYS, "cli")
    assert (got.models, got.rpm) == (["a", "b"], 3)
    assert got.credentials[0].hash == hash_secret(secret)
    code, out, err = await catalog_cli("key", "rotate", "cli", "--old-valid-for", "60", *url)
    assert code == 0, err
    rotated = await client.get(KEYS, "cli")
    assert [c.hash for c in rotated.credentials] == [hash_secret(secret),
                                                    hash_secret(out.splitlines()[-1])]  # fmt: skip


async def test_rotate_refuses_more_live_secrets_than_its_bound(client: CatalogClient) -> None:
    """Each live secret is a grant in the store (its allow-list up to 400 KB): rotations
    that all keep the old secrets live must not grow a key's grants without bound."""
    from shoal.catalog import ConflictError
    from shoal.catalog.repository import MAX_LIVE_SECRETS

    await client.create_key("k")
    later = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    for _ in range(MAX_LIVE_SECRETS - 1):
        await client.rotate_key("k", old_valid_until=later)
    with pytest.raises(ConflictError, match="live secrets"):
        await client.rotate_key("k", old_valid_until=later)
    assert len((await client.get(KEYS, "k")).credentials) == MAX_LIVE_SECRETS
    last = await client.rotate_key("k")  # ending the old ones at once is always possible
    assert len(last.credentials) == 1
