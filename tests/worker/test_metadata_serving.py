"""A card's metadata files are served as the bytes that were registered, capped in size."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from shoal.cards import ModelCard
from shoal.discovery import Discovery
from shoal.frontend.http.fetch import Fetcher
from shoal.store import Store
from shoal.worker import Engine, Runtime, ServedModel, status
from shoal.worker.http_server import STATUS_MAX_CONNECTIONS
from shoal.worker.metadata import MAX_METADATA_FILE
from tests.helpers import wait_for
from tests.worker.support import never_reading

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


async def test_files_whose_names_a_url_cannot_carry_are_skipped_and_the_model_announced(
    runtime: Runtime, store: Store, tmp_path: Path
) -> None:
    """A model directory scanned for metadata files listed every name: one file whose name
    is not UTF-8 (`extra\\xff.json`, left by some tool) made the card unencodable, so the
    whole model was refused (`UnicodeEncodeError`) and the worker announced nothing; one
    named with a backslash was listed with a URL the status server answers 400, so no
    frontend could verify the card. Such files are skipped, as an oversized one is; the
    model is announced with the others, each served as listed."""
    (tmp_path / "config.json").write_text('{"layers": 2}')
    (tmp_path / "tokenizer.json").write_text('{"vocab": {}}')
    (tmp_path / "extra\\x.json").write_text("{}")
    (tmp_path / os.fsdecode(b"extra\xff.json")).write_bytes(b"{}")  # (not UTF-8)
    await runtime.endpoint(EP).serve(OneModel(tmp_path))
    [model] = await Discovery(store).list()
    files = model.card.metadata_files
    assert set(files) == {"config.json", "tokenizer.json"}
    async with aiohttp.ClientSession() as http:
        for meta in files.values():
            async with http.get(meta.url) as resp:
                assert resp.status == 200
                body = await resp.read()
            assert f"sha256:{hashlib.sha256(body).hexdigest()}" == meta.checksum


async def test_metadata_files_with_unicode_spaces_and_url_characters_are_announced_and_fetched(
    runtime: Runtime, store: Store, tmp_path: Path
) -> None:
    """Names a URL carries quoted (`tokenizer-日本.json`, spaces, `%`, `?`, `#`, `+`) are
    announced with the others and each is served as listed."""
    names = ["config.json", "tokenizer-日本.json", "my file.json", "a%20b.json", "q?.json",
             "h#.json", "p+q.json", "e\u0301.json"]  # fmt: skip
    for n, name in enumerate(names):
        (tmp_path / name).write_text(f'{{"n": {n}}}')
    await runtime.endpoint(EP).serve(OneModel(tmp_path))
    [model] = await Discovery(store).list()
    files = model.card.metadata_files
    assert set(files) == set(names)
    async with aiohttp.ClientSession() as http:
        for name, meta in files.items():
            async with http.get(meta.url) as resp:
                assert resp.status == 200, (name, meta.url)
                body = await resp.read()
            assert body == (tmp_path / name).read_bytes(), name
    fetcher = Fetcher()  # (the gateway's own client, which fetches small files)
    try:
        for name, meta in files.items():
            assert Fetcher.handles(meta.url), meta.url
            assert await fetcher.get(meta.url, 1024, 10) == (tmp_path / name).read_bytes()
    finally:
        fetcher.close()


@pytest.mark.parametrize("name", ["a\\b.json", "extra\udcff.json"])
async def test_a_metadata_file_named_so_no_url_carries_it_is_refused_at_registration(
    runtime: Runtime, store: Store, tmp_path: Path, name: str
) -> None:
    """Named explicitly, such a file is refused with a `ValueError` naming it (before, the
    backslash one was announced unservable, the other failed as a `UnicodeEncodeError`)."""
    await runtime.endpoint(EP).serve(OneModel(tmp_path / "nothing"), attach_models=False)
    path = tmp_path / "config.json"
    path.write_text("{}")
    card = ModelCard.build(
        display_name="odd", slug="odd", source="test://odd", model_types=["chat"],
        context_length=1024,
    )  # fmt: skip
    with pytest.raises(ValueError, match="metadata file name"):
        await runtime.endpoint(EP).attach_model(card, files={name: path})
    assert await Discovery(store).list() == []
    assert len(runtime.metadata) == 0


async def test_clients_that_never_read_a_metadata_file_are_cut_and_live_answers_again(
    store_url: str, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """128 clients that asked for an 8 MiB tokenizer and read none of it held every place
    of the status server for good: `/live` answered 503 `too_many_connections` (still after
    25 s, and a frontend could fetch no metadata). Their connections are now cut once they
    read nothing for the status server's send timeout, and `/live` answers 200."""
    # (12 s: the 128 held places must be seen before they are cut, on a loaded machine too;
    # with 4 s a full suite beside other work saw them cut first)
    monkeypatch.setattr(status, "STATUS_SEND_TIMEOUT", 12.0, raising=False)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * (8 << 20))
    async with Runtime(store_url, lease_ttl=5) as runtime:
        await runtime.endpoint(EP).serve(OneModel(tmp_path))
        [model] = await Discovery(store).list()
        url = URL(model.card.metadata_files["tokenizer.json"].url)
        assert url.port is not None
        held = [await never_reading(url.port, url.raw_path) for _ in range(STATUS_MAX_CONNECTIONS)]
        try:
            async with aiohttp.ClientSession() as http:

                async def live() -> bool:
                    async with http.get(runtime.status_url + "/live") as response:
                        return response.status == 200

                async def refused() -> bool:
                    return not await live()

                await wait_for(refused, message="the unread answers never held every place")
                await wait_for(
                    live, timeout=30, message="/live never answered past the unread answers"
                )
        finally:
            for sock in held:
                sock.close()
