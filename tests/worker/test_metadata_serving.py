"""A card's metadata files are served as the bytes that were registered, capped in size."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from shoal.cards import ModelCard
from shoal.discovery import Discovery
from shoal.store import Store
from shoal.worker import Engine, Runtime, ServedModel
from shoal.worker.metadata import MAX_METADATA_FILE

EP = "ns.backend.generate"


@pytest.fixture
def store_url() -> str:
    return f"memory://{uuid.uuid4().hex}"


@pytest.fixture
async def runtime(store_url: str) -> AsyncIterator[Runtime]:
    rt = Runtime(store_url, lease_ttl=5)
    await rt.start()
    yield rt
    await rt.drain(timeout=1)


class OneModel(Engine):
    """Serves one model whose metadata files sit in a directory the test edits."""

    name = "one"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def app(self) -> web.Application:
        return web.Application()

    async def served_models(self) -> list[ServedModel]:
        return [ServedModel(name="m", source="test://m", metadata_dir=self.directory)]


async def test_metadata_edited_or_grown_after_registration_is_served_as_registered(
    runtime: Runtime, store: Store, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text('{"layers": 2}')
    (tmp_path / "tokenizer.json").write_text('{"vocab": {}}')
    await runtime.endpoint(EP).serve(OneModel(tmp_path))
    [model] = await Discovery(store).list()
    files = model.card.metadata_files
    assert set(files) == {"config.json", "tokenizer.json"}

    (tmp_path / "config.json").write_text('{"layers": 200, "edited": true}')
    with (tmp_path / "tokenizer.json").open("r+b") as grown:
        grown.truncate(MAX_METADATA_FILE + 1)  # sparse: fast, and over the cap

    async with aiohttp.ClientSession() as http:
        for meta in files.values():
            async with http.get(meta.url) as resp:
                assert resp.status == 200
                body = await resp.read()
            assert len(body) == meta.size
            assert f"sha256:{hashlib.sha256(body).hexdigest()}" == meta.checksum


async def test_a_metadata_file_over_the_cap_is_refused_at_registration(
    runtime: Runtime, store: Store, tmp_path: Path
) -> None:
    await runtime.endpoint(EP).serve(OneModel(tmp_path / "nothing"), attach_models=False)
    big = tmp_path / "tokenizer.json"
    with big.open("wb") as fh:
        fh.truncate(MAX_METADATA_FILE + 1)
    card = ModelCard.build(
        display_name="big", slug="big", source="test://big", model_types=["chat"],
        context_length=1024,
    )  # fmt: skip
    with pytest.raises(ValueError, match="tokenizer"):
        await runtime.endpoint(EP).attach_model(card, files={"tokenizer.json": big})
    assert await Discovery(store).list() == []
    assert len(runtime.metadata) == 0
