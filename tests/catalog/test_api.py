"""The catalog API's rules, on SQLite and PostgreSQL, through the typed client over HTTP."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from shoal.catalog import (
    DEPLOYMENTS,
    MODELS,
    PROVIDERS,
    VIRTUAL_MODELS,
    CatalogClient,
    CatalogConfig,
    CatalogServer,
    ConflictError,
    InvalidError,
    NotFoundError,
    UnauthorizedError,
)


async def test_create_then_get_returns_version_one_and_fields(client: CatalogClient) -> None:
    made = await client.create(
        MODELS,
        {"name": "llama-3-8b", "base_model": "meta-llama/Llama-3-8B", "context_length": 8192},
    )
    got = await client.get(MODELS, "llama-3-8b")
    assert made.version == got.version == 1
    assert (got.workspace, got.base_model, got.context_length) == (
        "team-a",
        "meta-llama/Llama-3-8B",
        8192,
    )
    assert got.created_at == made.created_at


async def test_names_with_slashes_round_trip(client: CatalogClient) -> None:
    await client.create(MODELS, {"name": "meta-llama/Llama-3-8B"})
    assert (await client.get(MODELS, "meta-llama/Llama-3-8B")).name == "meta-llama/Llama-3-8B"
    await client.delete(MODELS, "meta-llama/Llama-3-8B")
    with pytest.raises(NotFoundError):
        await client.get(MODELS, "meta-llama/Llama-3-8B")


async def test_create_of_existing_name_is_409_naming_it(client: CatalogClient) -> None:
    await client.create(VIRTUAL_MODELS, {"name": "chat", "default_model": "llama"})
    with pytest.raises(ConflictError) as caught:
        await client.create(VIRTUAL_MODELS, {"name": "chat", "default_model": "other"})
    assert "'chat'" in caught.value.message and caught.value.param == "name"
    assert (await client.get(VIRTUAL_MODELS, "chat")).default_model == "llama"


async def test_every_change_bumps_version_and_stale_version_is_409(client: CatalogClient) -> None:
    await client.create(MODELS, {"name": "m"})
    v2 = await client.update(MODELS, "m", {"description": "first"}, version=1)
    assert v2.version == 2
    with pytest.raises(ConflictError) as caught:
        await client.update(MODELS, "m", {"description": "lost update"}, version=1)
    assert caught.value.param == "version"
    with pytest.raises(ConflictError):
        await client.delete(MODELS, "m", version=1)
    got = await client.get(MODELS, "m")
    assert (got.version, got.description) == (2, "first")
    await client.delete(MODELS, "m", version=2)
    with pytest.raises(NotFoundError):
        await client.get(MODELS, "m")


async def test_update_that_changes_nothing_keeps_the_version(client: CatalogClient) -> None:
    await client.create(MODELS, {"name": "m", "providers": ["team-a/p"]})
    same = await client.update(MODELS, "m", {"providers": ["team-a/p"]}, version=1)
    assert same.version == 1


async def test_invalid_field_is_422_naming_it(client: CatalogClient) -> None:
    with pytest.raises(InvalidError) as caught:
        await client.create(MODELS, {"name": "m", "context_length": -1})
    assert caught.value.param == "context_length"
    with pytest.raises(InvalidError) as caught:
        await client.create(PROVIDERS, {"name": "p", "type": "url"})
    assert caught.value.param == "base_url"
    await client.create(MODELS, {"name": "m"})
    with pytest.raises(InvalidError) as caught:
        await client.update(MODELS, "m", {"context_length": "long"})
    assert caught.value.param == "context_length"
    with pytest.raises(InvalidError) as caught:
        await client.create(MODELS, {"name": "bad name!"})
    assert caught.value.param == "name"
    with pytest.raises(InvalidError) as caught:
        await client.create(MODELS, {"name": "n", "spec": {"x": "a\x00b"}})
    assert caught.value.param == "spec.x"


async def test_unknown_workspace_or_name_is_404(client: CatalogClient) -> None:
    with pytest.raises(NotFoundError) as caught:
        await client.list(MODELS, workspace="nobody")
    assert caught.value.param == "workspace"
    with pytest.raises(NotFoundError):
        await client.get(MODELS, "m", workspace="nobody")
    await client.create(MODELS, {"name": "m"})
    with pytest.raises(NotFoundError):
        await client.get(MODELS, "absent")
    with pytest.raises(NotFoundError):
        await client.update(MODELS, "absent", {"description": "x"})
    with pytest.raises(NotFoundError):
        await client.delete(MODELS, "absent")


async def test_workspaces_are_created_on_first_use(client: CatalogClient) -> None:
    assert await client.workspaces() == []
    await client.create(MODELS, {"name": "m"}, workspace="blue")
    await client.create(MODELS, {"name": "m"}, workspace="green")
    await client.create(PROVIDERS, {"name": "p", "type": "fleet"}, workspace="blue")
    assert [w.name for w in await client.workspaces()] == ["blue", "green"]
    assert (await client.list(MODELS, workspace="green")).total == 1


async def test_secret_is_only_a_name_and_a_value_is_refused(client: CatalogClient) -> None:
    made = await client.create(
        PROVIDERS,
        {
            "name": "hosted",
            "type": "url",
            "base_url": "https://api.example/v1",
            "auth_secret": "HOSTED_KEY",
        },
    )
    assert made.auth_secret == "HOSTED_KEY"
    with pytest.raises(InvalidError) as caught:
        await client.create(
            PROVIDERS,
            {"name": "leak", "type": "url", "base_url": "https://x/v1", "api_key": "sk-123"},
        )
    assert caught.value.param == "api_key"
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{client.base_url}/v1/workspaces/team-a/providers") as resp,
    ):
        text = await resp.text()
    assert "HOSTED_KEY" in text and "sk-123" not in text


async def test_a_base_url_with_a_query_is_refused_without_repeating_it(
    client: CatalogClient,
) -> None:
    """A query in a provider's base URL was accepted, then dropped from every request the
    gateway made (and shown whole in its errors): now refused with 422, the value not echoed."""
    for url in ("https://api.example/v1?key=QUERYSECRET", "https://api.example/v1#QUERYSECRET"):
        with pytest.raises(InvalidError) as caught:
            await client.create(PROVIDERS, {"name": "q", "type": "url", "base_url": url})
        assert caught.value.param == "base_url"
        assert "query or fragment" in str(caught.value)
        assert "QUERYSECRET" not in str(caught.value)


async def test_list_pages_sorts_filters_and_counts(client: CatalogClient) -> None:
    for i in range(25):
        await client.create(
            MODELS, {"name": f"m{i:02d}", "format": "gguf" if i % 2 else "safetensors"}
        )
    first = await client.list(MODELS, page_size=10)
    assert (first.total, first.next_page, [m.name for m in first.items][:2]) == (
        25,
        2,
        ["m00", "m01"],
    )
    last = await client.list(MODELS, page=3, page_size=10)
    assert (len(last.items), last.next_page) == (5, None)
    beyond = await client.list(MODELS, page=9, page_size=10)
    assert (beyond.items, beyond.total) == ([], 25)
    newest = await client.list(MODELS, sort="-name", page_size=1)
    assert newest.items[0].name == "m24"
    gguf = await client.list_all(MODELS, filters={"format": "gguf"}, page_size=5)
    assert [m.name for m in gguf] == [f"m{i:02d}" for i in range(1, 25, 2)]
    with pytest.raises(InvalidError) as caught:
        await client.list(MODELS, filters={"context_length": "1"})
    assert caught.value.param == "filter.0"  # the first filter
    with pytest.raises(InvalidError) as caught:
        await client.list(MODELS, page_size=1001)
    assert caught.value.param == "page_size"


async def test_deployment_status_changes_are_kept_in_history(client: CatalogClient) -> None:
    await client.create(
        DEPLOYMENTS, {"name": "d", "model": "mock-llm", "engine": "mocker", "replicas": 2}
    )
    await client.update(DEPLOYMENTS, "d", {"status": "PENDING", "status_message": "starting 2"})
    await client.update(DEPLOYMENTS, "d", {"replicas": 3})
    got = await client.update(DEPLOYMENTS, "d", {"status": "READY", "status_message": ""})
    assert [h.status for h in got.status_history] == ["CREATED", "PENDING", "READY"]
    assert got.status_history[1].message == "starting 2" and got.version == 4


async def test_admin_token_guards_writes_and_reads_unless_public_read(database_url: str) -> None:
    for public_read in (False, True):
        server = CatalogServer(
            CatalogConfig(database_url, port=0, admin_token="s3cret", public_read=public_read)
        )
        await server.start()
        try:
            async with (
                CatalogClient(server.url) as anonymous,
                CatalogClient(server.url, token="wrong") as wrong,
                CatalogClient(server.url, token="s3cret") as admin,
            ):
                with pytest.raises(UnauthorizedError):
                    await anonymous.create(MODELS, {"name": f"m{public_read}"})
                with pytest.raises(UnauthorizedError):
                    await wrong.create(MODELS, {"name": f"m{public_read}"})
                await admin.create(MODELS, {"name": f"m{public_read}"})
                if public_read:
                    assert (await anonymous.get(MODELS, "mTrue")).version == 1
                else:
                    with pytest.raises(UnauthorizedError):
                        await anonymous.get(MODELS, "mFalse")
                    with pytest.raises(UnauthorizedError):
                        await anonymous.workspaces()
        finally:
            await server.stop()


async def test_concurrent_updates_of_one_version_let_exactly_one_win(client: CatalogClient) -> None:
    await client.create(MODELS, {"name": "m"})
    await client.create(MODELS, {"name": "other"})

    async def update(i: int) -> str:
        try:
            await client.update(MODELS, "m", {"description": f"writer {i}"}, version=1)
        except ConflictError:
            return "conflict"
        return "updated"

    async def create(i: int) -> str:
        await client.update(MODELS, "other", {"description": f"{i}"})  # no version: last wins
        return "unversioned"

    outcomes = await asyncio.gather(*(update(i) for i in range(8)), *(create(i) for i in range(4)))
    assert sorted(outcomes[:8]) == ["conflict"] * 7 + ["updated"]
    assert (await client.get(MODELS, "m")).version == 2
    assert (await client.get(MODELS, "other")).version == 5
