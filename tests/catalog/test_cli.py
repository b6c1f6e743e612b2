"""`shoal catalog` as users run it: real processes against a real catalog API."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic.script import ScriptDirectory

from shoal.bounds import MAX_DEPTH
from shoal.catalog import (
    KEYS,
    MODELS,
    PROVIDERS,
    VIRTUAL_MODELS,
    CatalogClient,
    CatalogConfig,
    CatalogServer,
    tables,
)
from shoal.catalog.apply import ApplyError, apply_documents, parse_documents
from shoal.catalog.database import MIGRATIONS
from shoal.catalog.resources import ModelSpec
from tests.helpers import free_port
from tests.postgres_server import PostgresDatabase
from tests.processes import Processes, shoal

DOCS = Path(__file__).resolve().parents[2] / "docs" / "catalog.md"


def docs_example() -> str:
    """The YAML block right after the `example: catalog.yaml` marker in docs/catalog.md."""
    text = DOCS.read_text()
    after = text[text.index("<!-- example: catalog.yaml") :]
    return after.split("```yaml\n", 1)[1].split("```", 1)[0]


async def catalog_cli(*args: str) -> tuple[int, str, str]:
    proc = await shoal(
        "catalog", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_docs_example_applies_then_reapplies_unchanged(
    catalog: CatalogServer, client: CatalogClient, tmp_path: Path
) -> None:
    example = tmp_path / "catalog.yaml"
    example.write_text(docs_example())
    code, out, err = await catalog_cli("apply", "-f", str(example), "--url", catalog.url)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 6 and all(line.endswith(" created") for line in lines), out
    assert "provider default/hosted created" in lines
    code, out, err = await catalog_cli("apply", "-f", str(example), "--url", catalog.url)
    assert code == 0, err
    assert [line.rsplit(" ", 1)[1] for line in out.splitlines()] == ["unchanged"] * 6, out
    hosted = await client.get(PROVIDERS, "hosted", workspace="default")
    assert (hosted.version, hosted.auth_secret) == (1, "HOSTED_KEY")


async def test_apply_updates_what_differs_and_prune_deletes_what_is_gone(
    catalog: CatalogServer, client: CatalogClient, tmp_path: Path
) -> None:
    file = tmp_path / "models.yaml"
    file.write_text("kind: Model\nname: a\n---\nkind: Model\nname: b\nformat: gguf\n")
    url = ["--url", catalog.url, "-w", "team-a"]
    assert (await catalog_cli("apply", "-f", str(file), *url))[0] == 0
    await client.update(MODELS, "a", {"autoprovisioned": False, "description": "drifted"})
    file.write_text('[{"kind": "models", "name": "a"}]')
    code, out, err = await catalog_cli("apply", "-f", str(file), "--prune", *url)
    assert code == 0, err
    assert out.splitlines() == ["model team-a/a updated", "model team-a/b deleted"]
    assert [m.name for m in await client.list_all(MODELS)] == ["a"]
    assert (await client.get(MODELS, "a")).description == ""


async def test_prune_keeps_keys_unless_the_file_declares_keys(
    catalog: CatalogServer, client: CatalogClient, tmp_path: Path
) -> None:
    """A key's secret cannot be applied back: a file of models applied with `--prune` must not
    delete the workspace's keys (every client of them locked out for good); a file that
    declares keys of a workspace prunes that workspace's other keys."""
    url = ["--url", catalog.url, "-w", "team-a"]
    for name in ("ci", "web"):
        code, _, err = await catalog_cli("key", "create", name, *url)
        assert code == 0, err
    file = tmp_path / "models.yaml"
    file.write_text("kind: Model\nname: a\n")
    code, out, err = await catalog_cli("apply", "-f", str(file), "--prune", *url)
    assert code == 0, err
    assert out.splitlines() == ["model team-a/a created"]
    assert sorted(k.name for k in await client.list_all(KEYS, workspace="team-a")) == ["ci", "web"]
    file.write_text("kind: Model\nname: a\n---\nkind: Key\nname: ci\n")
    code, out, err = await catalog_cli("apply", "-f", str(file), "--prune", *url)
    assert code == 0, err
    assert "key team-a/web deleted" in out.splitlines(), out
    assert [k.name for k in await client.list_all(KEYS, workspace="team-a")] == ["ci"]


async def test_get_yaml_output_applies_back_unchanged(
    catalog: CatalogServer, client: CatalogClient, tmp_path: Path
) -> None:
    await client.create(MODELS, {"name": "m", "context_length": 4096, "spec": {"k": [1, 2]}})
    await client.create(PROVIDERS, {"name": "p", "type": "fleet"})
    for kind in ("models", "providers"):
        code, out, err = await catalog_cli(
            "get", kind, "-o", "yaml", "--url", catalog.url, "-w", "team-a"
        )
        assert code == 0, err
        (tmp_path / f"{kind}.yaml").write_text(out)
        code, out, err = await catalog_cli(
            "apply", "-f", str(tmp_path / f"{kind}.yaml"), "--url", catalog.url
        )
        assert code == 0, err
        assert out.strip().endswith(" unchanged"), out
    code, out, _ = await catalog_cli("get", "models", "--url", catalog.url, "-w", "team-a")
    assert out.splitlines()[0].split()[:3] == ["NAME", "VERSION", "BASE_MODEL"]
    assert out.splitlines()[1].split()[:2] == ["m", "1"]


async def test_bad_file_is_refused_naming_document_and_field(
    catalog: CatalogServer, tmp_path: Path
) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text("kind: Model\nname: ok\n---\nkind: Model\nname: m\ncontext_length: -5\n")
    code, out, err = await catalog_cli("apply", "-f", str(file), "--url", catalog.url)
    assert code == 1 and out == ""
    assert "document 2" in err and "context_length" in err


@pytest.mark.parametrize("workspace", ["Team-A", "null", "a/b", "-x", "w" * 64, "[a]"])
async def test_a_file_naming_an_invalid_workspace_is_refused_before_anything_is_written(
    catalog: CatalogServer, client: CatalogClient, tmp_path: Path, workspace: str
) -> None:
    """A document's `workspace` was not checked with the file: the documents before it (in
    kind order) were created, then the API refused that one (422), leaving the file half
    applied. It is checked with the rest of the file now, naming the document and field."""
    file = tmp_path / "bad.yaml"
    file.write_text(
        f"kind: Model\nname: ok\nworkspace: team-a\n---\n"
        f"kind: VirtualModel\nname: vm\ndefault_model: ok\nworkspace: {workspace}\n"
    )
    code, out, err = await catalog_cli("apply", "-f", str(file), "--url", catalog.url)
    assert code == 1 and out == "", (out, err)
    assert "document 2" in err and "workspace" in err, err
    assert await client.workspaces() == []  # nothing made, not even team-a


async def test_serve_migrate_get_delete_end_to_end(processes: Processes, tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'c.db'}"
    code, out, err = await catalog_cli("migrate", "--db", db)
    head = ScriptDirectory(MIGRATIONS).get_current_head()
    assert code == 0 and f"at revision {head}" in out, err
    served = await processes.start(
        "catalog", "serve", "--db", db, "--port", str(free_port()), "--admin-token", "tok",
        ready="catalog",
    )  # fmt: skip
    file = tmp_path / "m.json"
    file.write_text('{"kind": "Model", "name": "m"}')
    auth = ["--url", served.url, "--admin-token", "tok"]
    assert (await catalog_cli("apply", "-f", str(file), *auth))[1] == "model default/m created\n"
    code, _, err = await catalog_cli("get", "models", "m", "--url", served.url)
    assert code == 1 and "admin token" in err
    code, out, _ = await catalog_cli("get", "models", "m", "-o", "json", *auth)
    assert code == 0 and '"name": "m"' in out
    assert (await catalog_cli("delete", "models", "m", *auth))[1] == "model default/m deleted\n"
    code, _, err = await catalog_cli("delete", "models", "m", *auth)
    assert code == 1 and "no Model 'm'" in err


async def test_up_runs_the_catalog_beside_the_frontend(
    processes: Processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHOAL_CATALOG_DB", f"sqlite:///{tmp_path / 'catalog.db'}")
    catalog_port = free_port()
    await processes.start(
        "up", "--workers", "0", "--port", str(free_port()), "--catalog-port", str(catalog_port),
        "--store", f"sqlite:///{tmp_path / 'store.db'}",
        ready=re.compile(r"^Press Ctrl-C to stop\.$"), timeout=60,
    )  # fmt: skip
    file = tmp_path / "alias.yaml"
    file.write_text("kind: VirtualModel\nname: chat\ndefault_model: mock-llm\n")
    url = f"http://127.0.0.1:{catalog_port}"
    code, out, err = await catalog_cli("apply", "-f", str(file), "--url", url)
    assert (code, out) == (0, "virtual-model default/chat created\n"), err
    assert (tmp_path / "catalog.db").exists()


async def test_apply_leaves_fields_the_controller_writes(
    catalog: CatalogServer, client: CatalogClient, tmp_path: Path
) -> None:
    file = tmp_path / "m.yaml"
    file.write_text(
        "kind: Model\nname: m\nworkspace: team-a\n---\n"
        "kind: Provider\nname: p\nworkspace: team-a\ntype: fleet\n"
    )
    assert (await catalog_cli("apply", "-f", str(file), "--url", catalog.url))[0] == 0
    await client.update(MODELS, "m", {"providers": ["team-a/p"]})  # as the controller links it
    await client.update(PROVIDERS, "p", {"status": "READY", "served_models": []})
    code, out, err = await catalog_cli("apply", "-f", str(file), "--url", catalog.url)
    assert code == 0 and out.split() == [
        "provider", "team-a/p", "unchanged", "model", "team-a/m", "unchanged",
    ], out + err  # fmt: skip
    assert (await client.get(MODELS, "m")).providers == ["team-a/p"]


@pytest.fixture
async def sqlite_catalog(tmp_path: Path) -> AsyncIterator[CatalogServer]:
    """A catalog on SQLite only, for what does not depend on the database."""
    server = CatalogServer(CatalogConfig(database_url=f"sqlite:///{tmp_path / 'c.db'}", port=0))
    await server.start()
    yield server
    await server.stop()


async def test_get_and_delete_act_on_exactly_the_named_resource(
    sqlite_catalog: CatalogServer,
) -> None:
    catalog = sqlite_catalog
    async with CatalogClient(catalog.url, workspace="team-a") as client:
        for name in ("a/b", "a", "b", "y"):
            await client.create(MODELS, {"name": name})
        # a name from before dot segments were refused, as the database may still hold one
        assert catalog.engine is not None
        now = datetime.now(UTC)
        async with catalog.engine.begin() as conn:
            await conn.execute(
                tables.models.insert().values(
                    workspace="team-a", name="x/../y", version=1, created_at=now, updated_at=now,
                    data=ModelSpec().model_dump(mode="json"),
                )
            )  # fmt: skip
        url = ["--url", catalog.url, "-w", "team-a"]
        others = ("a%2Fb", "a/b?x", "a/b#x", "a/b x")
        results = await asyncio.gather(
            *(catalog_cli("get", "models", name, "-o", "json", *url) for name in others),
            catalog_cli("get", "models", "x/../y", "-o", "json", *url),
        )
        assert [code for code, _, _ in results[:-1]] == [1] * len(others), results
        code, out, err = results[-1]
        assert code == 0 and json.loads(out)["name"] == "x/../y", err
        results = await asyncio.gather(
            *(catalog_cli("delete", "models", name, *url) for name in others),
            catalog_cli("delete", "models", "x/../y", *url),
        )
        assert [code for code, _, _ in results] == [1] * len(others) + [0], results
        assert [m.name for m in await client.list_all(MODELS)] == ["a", "a/b", "b", "y"]
        assert (await catalog_cli("delete", "models", "a/b", *url))[0] == 0
        assert [m.name for m in await client.list_all(MODELS)] == ["a", "b", "y"]


async def test_concurrent_applies_of_one_file_both_succeed(
    catalog: CatalogServer, client: CatalogClient, tmp_path: Path
) -> None:
    """Whoever loses a race (the name was just created, the version just bumped) reads the
    resource again and adopts it: updates what still differs, or reports it unchanged."""
    text = "".join(f"kind: Model\nname: m{i}\nformat: gguf\n---\n" for i in range(8))
    documents = parse_documents(text, workspace="team-a")
    async with CatalogClient(catalog.url) as other:
        for _ in range(2):  # from nothing, then over a drift both see
            outcomes = await asyncio.gather(
                apply_documents(client, documents), apply_documents(other, documents)
            )
            assert [len(changes) for changes in outcomes] == [8, 8]
            for i in range(8):
                await client.update(MODELS, f"m{i}", {"format": "drifted"})
    if catalog.config.database_url.startswith("sqlite"):  # the command, once
        file = tmp_path / "models.yaml"
        file.write_text(text.replace("name: m", "name: n"))
        url = ["--url", catalog.url, "-w", "team-a"]
        results = await asyncio.gather(
            *(catalog_cli("apply", "-f", str(file), *url) for _ in range(2))
        )
        assert [code for code, _, _ in results] == [0, 0], results
        assert len(await client.list_all(MODELS)) == 16


async def test_urls_in_messages_carry_no_credentials(postgres: PostgresDatabase) -> None:
    database = postgres.url.replace("postgres@", "postgres:hunter2@", 1)
    assert "hunter2" in database
    (code, out, err), (code2, _, err2) = await asyncio.gather(
        catalog_cli("migrate", "--db", database),
        catalog_cli("get", "models", "--url", f"http://admin:hunter2@127.0.0.1:{free_port()}"),
    )
    assert code == 0 and "at revision" in out, err
    assert code2 == 1 and "cannot reach the catalog at http://***@127.0.0.1:" in err2
    assert "hunter2" not in out + err + err2


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1000, 100_000])
def test_files_nested_past_the_bound_are_refused_not_crashed(depth: int) -> None:
    flow = "kind: Model\nname: m\nspec: {a: " + "[" * depth + "]" * depth + "}\n"
    block = "kind: Model\nname: m\nspec:\n" + "".join(
        " " * i + "a:\n" for i in range(1, min(depth, 5000))
    )
    for text, json_only in ((flow, False), (block, False), (flow.replace("a:", '"a":'), True)):
        with pytest.raises(ApplyError, match="nested"):
            parse_documents(text, workspace="w", json_only=json_only)


def test_yaml_aliases_and_files_over_the_byte_bound_are_refused() -> None:
    """A 497-byte file of nested aliases expanded to 10**8 nodes (MemoryError): aliases are
    refused as they are met, and a file over `MAX_FILE_BYTES` before it is parsed."""
    from shoal.catalog.apply import MAX_FILE_BYTES

    bomb = "kind: Model\nname: bomb\nspec:\n  a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, 8):
        bomb += f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n"
    simple = "kind: Model\nname: m\nspec: {a: &one [1], b: *one}\n"
    for text in (bomb, simple):
        with pytest.raises(ApplyError, match=r"alias \*a0|alias \*one"):
            parse_documents(text, workspace="w")
    anchored = "kind: Model\nname: m\nspec: {a: &one [1]}\n"  # an anchor alone is fine
    assert parse_documents(anchored, workspace="w")[0].label
    big = "kind: Model\nname: m\ndescription: x\n" + "#" * MAX_FILE_BYTES
    with pytest.raises(ApplyError, match=f"over {MAX_FILE_BYTES} bytes"):
        parse_documents(big, workspace="w")


async def test_prune_deletes_a_resource_the_controller_updates_meanwhile(
    catalog: CatalogServer, client: CatalogClient
) -> None:
    """The controller writes statuses all the time (a provider's `status`, a virtual model's
    `status_message`): a prune whose delete finds the version just bumped reads the resource
    again and deletes it still, instead of failing the whole apply with a 409 halfway."""
    for name in ("keep", "gone", "later"):
        await client.create(VIRTUAL_MODELS, {"name": name, "default_model": "m"})

    class Racing(CatalogClient):
        async def list_all(self, kind: Any, **kwargs: Any) -> Any:
            items = await super().list_all(kind, **kwargs)
            if kind is VIRTUAL_MODELS:  # the controller writes after the listing
                for name in ("gone", "later"):
                    await client.update(VIRTUAL_MODELS, name, {"status_message": "no route"})
            return items

    documents = parse_documents(
        "kind: VirtualModel\nname: keep\ndefault_model: m\n", workspace="team-a"
    )
    async with Racing(catalog.url) as racing:
        changes = await apply_documents(racing, documents, prune=True)
    assert sorted(str(c) for c in changes if c.action == "deleted") == [
        "virtual-model team-a/gone deleted", "virtual-model team-a/later deleted",
    ]  # fmt: skip
    assert [vm.name for vm in await client.list_all(VIRTUAL_MODELS)] == ["keep"]
