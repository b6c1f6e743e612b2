"""`shoal ls` shows what other processes registered through the store."""

from __future__ import annotations

import asyncio
import json

import msgspec

from shoal.cards import ModelCard
from shoal.discovery import EndpointId, InstanceInfo, ModelKey
from shoal.discovery.keys import instance_key
from shoal.store import open_store
from tests.processes import shoal
from tests.worker.conftest import StartWorker


async def shoal_ls(*args: str) -> tuple[int, str, str]:
    proc = await shoal("ls", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_ls_shows_models_instances_and_taints_registered_by_other_processes(
    start_worker: StartWorker, store_url: str
) -> None:
    a = await start_worker("--namespace", "team-a")
    b = await start_worker("--namespace", "team-b", model="other-model")
    code, out, _ = await shoal_ls("--store", store_url, "--json")
    assert code == 0
    data = json.loads(out)
    listed = {(m["model"], m["endpoint"], m["instance"], m["url"]) for m in data["models"]}
    assert listed == {
        ("mock-model", "team-a.backend.generate", f"{a.instance_id:x}", a.url),
        ("other-model", "team-b.backend.generate", f"{b.instance_id:x}", b.url),
    }
    assert {i["status_url"] for i in data["instances"]} == {a.status_url, b.status_url}

    code, out, _ = await shoal_ls("--store", store_url, "--namespace", "team-b")
    assert code == 0
    assert "other-model" in out and "mock-model" not in out and f"{b.instance_id:x}" in out


async def test_ls_on_an_unreachable_store_fails_with_a_message_naming_it() -> None:
    code, _, err = await shoal_ls("--store", "sqlite:///dev/null/nope/store.db")
    assert code == 1
    assert "sqlite:///dev/null/nope/store.db" in err


async def test_ls_counts_and_names_values_written_by_hand_that_are_not_cards(
    start_worker: StartWorker, store_url: str
) -> None:
    worker = await start_worker("--namespace", "team-a")
    store = await open_store(store_url)
    try:
        await store.put(f"shoal/v1/models/team-a/backend/generate/{worker.instance_id:x}/bad", b"{")
        await store.put("shoal/v1/instances/team-a/backend/generate/00ff", b"{}")
    finally:
        await store.close()
    code, out, _ = await shoal_ls("--store", store_url, "--json")
    assert code == 0
    data = json.loads(out)
    assert [m["model"] for m in data["models"]] == ["mock-model"]  # the valid card stays listed
    assert len(data["skipped"]) == 2
    assert all(entry["reason"] for entry in data["skipped"])
    code, out, _ = await shoal_ls("--store", store_url)
    assert "2 value(s) skipped" in out and "/bad" in out


async def test_ls_never_prints_the_credentials_of_a_url_another_writer_registered(
    store_url: str,
) -> None:
    """A worker behind Basic auth registers `http://user:password@host:port` (the frontend
    sends it as Basic credentials and its dashboard shows it redacted): `shoal ls`, whose
    output is pasted into tickets, shows neither the password nor a query, table or JSON."""
    endpoint = EndpointId("team-a", "backend", "generate")
    info = InstanceInfo(
        namespace="team-a",
        component="backend",
        endpoint="generate",
        instance_id=0x2A,
        url="http://worker:s3cret-pw@10.0.0.7:9000",
        status_url="http://10.0.0.7:9090?token=s3cret-token",
    )
    card = ModelCard.build(
        display_name="basic-model", slug="basic-model", source="test", model_types=["chat"],
        context_length=4096,
    )  # fmt: skip
    store = await open_store(store_url)
    try:
        await store.put(instance_key(endpoint, 0x2A), msgspec.json.encode(info))
        await store.put(ModelKey(endpoint, 0x2A).key, card.to_json())
    finally:
        await store.close()
    for args in (("--json",), ()):
        code, out, _ = await shoal_ls("--store", store_url, *args)
        assert code == 0
        assert "basic-model" in out and "10.0.0.7:9000" in out and "10.0.0.7:9090" in out
        assert "s3cret" not in out, out


async def test_ls_shows_control_characters_of_a_registered_value_escaped(store_url: str) -> None:
    """Any writer of the store names its model: an escape sequence in a name reached the
    operator's terminal as is (retitling it, clearing it), and a newline forged a row."""
    endpoint = EndpointId("team-a", "backend", "generate")
    info = InstanceInfo(
        namespace="team-a", component="backend", endpoint="generate", instance_id=0x2B,
        url="http://10.0.0.8:9000", status_url="http://10.0.0.8:9090",
    )  # fmt: skip
    card = ModelCard.build(
        display_name="evil\x1b]0;owned\x07\x1b[2J\nforged-row", slug="evil", source="test",
        model_types=["chat"], context_length=4096, runtime_config={"taints": ["t\rx"]},
    )  # fmt: skip
    store = await open_store(store_url)
    try:
        await store.put(instance_key(endpoint, 0x2B), msgspec.json.encode(info))
        await store.put(ModelKey(endpoint, 0x2B).key, card.to_json())
    finally:
        await store.close()
    code, out, _ = await shoal_ls("--store", store_url)
    assert code == 0
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out
    assert not any(line.startswith("forged-row") for line in out.splitlines())
    assert "evil\\x1b]0;owned\\x07\\x1b[2J\\nforged-row" in out
