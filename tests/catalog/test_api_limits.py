"""What the catalog API refuses, and how: every bound answers 422 naming the field (400 for a
body that is not JSON or nests past `shoal.bounds.MAX_DEPTH`), never 500, on SQLite and
PostgreSQL. Raw HTTP where the typed client could not send the body."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest

from shoal.bounds import MAX_DEPTH
from shoal.catalog import (
    DEPLOYMENTS,
    MODELS,
    PROVIDERS,
    VIRTUAL_MODELS,
    CatalogClient,
    CatalogConfig,
    CatalogServer,
)
from shoal.catalog.api import MAX_BODY_BYTES
from shoal.catalog.errors import InvalidError
from shoal.catalog.resources import (
    BASE_URL_LENGTH,
    DEPLOYMENT_NAME_LENGTH,
    ENGINE_ARGS_COUNT,
    FREE_FORM_BYTES,
    FREE_FORM_DEPTH,
    TARGETS_LENGTH,
)
from shoal.discovery.routes import Route, UrlTarget
from shoal.store import MAX_VALUE_BYTES


async def send(client: CatalogClient, method: str, path: str, body: str | bytes) -> Any:
    """(status, error) of a raw request with `body` to `path` under the client's workspace."""
    url = f"{client.base_url}/v1/workspaces/{client.workspace}/{path}"
    headers = {"Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, data=body, headers=headers) as resp,
    ):
        answer = await resp.json(content_type=None)
    return resp.status, (answer or {}).get("error", {}) if isinstance(answer, dict) else {}


def nested(depth: int) -> dict[str, Any]:
    """An object nesting `depth` levels (itself included)."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


async def test_free_form_fields_share_one_depth_bound_named_in_422(client: CatalogClient) -> None:
    deep = nested(FREE_FORM_DEPTH + 1)
    with pytest.raises(InvalidError) as caught:
        await client.create(MODELS, {"name": "m", "spec": deep})
    assert caught.value.param == "spec" and str(FREE_FORM_DEPTH) in caught.value.message
    with pytest.raises(InvalidError) as caught:
        await client.create(
            DEPLOYMENTS, {"name": "d", "model": "m", "engine": "mocker", "engine_args": deep}
        )
    assert caught.value.param == "engine_args"
    await client.create(MODELS, {"name": "m", "spec": nested(FREE_FORM_DEPTH)})
    with pytest.raises(InvalidError) as caught:
        await client.update(MODELS, "m", {"spec": deep})
    assert caught.value.param == "spec"
    # what the API accepted, its own client reads back, alone and in a page
    assert (await client.get(MODELS, "m")).spec == nested(FREE_FORM_DEPTH)
    assert [m.name for m in await client.list_all(MODELS)] == ["m"]


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 256, 1000, 100_000])
async def test_bodies_nested_past_the_bound_are_400_never_500(
    client: CatalogClient, depth: int
) -> None:
    await client.create(MODELS, {"name": "m"})
    spec = "[" * depth + "]" * depth
    body = f'{{"name": "n", "spec": {spec}}}'
    for method, path in (("POST", "models"), ("PATCH", "models/m"), ("PUT", "models/m")):
        status, error = await send(client, method, path, body)
        if method == "PUT":  # no such route: refused before the body is read
            assert status == 405
            continue
        assert status == 400, (method, status, error)
        assert error["param"] is None and f"{MAX_DEPTH} levels" in error["message"]
    assert [m.name for m in await client.list_all(MODELS)] == ["m"]


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('{"name": "m", "spec": {"a": NaN}}', "spec.a"),
        ('{"name": "m", "spec": {"a": [1, Infinity]}}', "spec.a.1"),
        ('{"name": "m", "spec": {"a": -Infinity}}', "spec.a"),
        ('{"name": "m", "spec": {"a": "x\\ud800y"}}', "spec.a"),
        ('{"name": "m", "spec": {"k\\udfff": 1}}', "spec"),
        ('{"name": "m", "description": "\\ud83d"}', "description"),
    ],
)
async def test_nan_infinity_and_lone_surrogates_are_422_naming_the_field(
    client: CatalogClient, text: str, where: str
) -> None:
    status, error = await send(client, "POST", "models", text)
    assert (status, error["param"]) == (422, where), error
    await client.create(MODELS, {"name": "m"})
    patch = text.replace('"name": "m", ', "")
    status, error = await send(client, "PATCH", "models/m", patch)
    assert (status, error["param"]) == (422, where), error
    got = await client.get(MODELS, "m")
    assert (got.version, got.spec, got.description) == (1, {}, "")


async def test_malformed_json_is_400_saying_where(client: CatalogClient) -> None:
    status, error = await send(client, "POST", "models", '{"name": "m",\n "spec": {,}}')
    assert (status, error["param"]) == (400, None), error
    assert "line 2 column 11" in error["message"], error
    await client.create(MODELS, {"name": "m"})
    status, error = await send(client, "PATCH", "models/m", "{")
    assert (status, error["param"]) == (400, None), error
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{client.base_url}/openapi.json") as resp,
    ):
        openapi = await resp.json()
    for path, operations in openapi["paths"].items():
        for method, operation in operations.items():
            if method in ("post", "patch"):
                assert "400" in operation["responses"], (method, path)


@pytest.mark.parametrize("name", ["a/../b", "a/./b", "a/..", "a/.", "x/y/../z", "a/b/."])
async def test_names_with_dot_segments_are_422(client: CatalogClient, name: str) -> None:
    for kind, body in (
        (MODELS, {}),
        (PROVIDERS, {"type": "fleet"}),
        (VIRTUAL_MODELS, {"default_model": "m"}),
        (DEPLOYMENTS, {"model": "m", "engine": "mocker"}),
    ):
        with pytest.raises(InvalidError) as caught:
            await client.create(kind, {"name": name, **body})
        assert caught.value.param == "name" and "segment" in caught.value.message
    with pytest.raises(InvalidError) as caught:  # a key's name too (its create is its own)
        await client.create_key(name)
    assert caught.value.param == "name" and "segment" in caught.value.message
    # a reference may name anything: a name that cannot exist only resolves to nothing
    await client.create(VIRTUAL_MODELS, {"name": "vm", "default_model": name})
    await client.delete(VIRTUAL_MODELS, "vm")
    # dots inside a segment are ordinary characters
    await client.create(MODELS, {"name": "a/..b/c.d/..."})
    assert (await client.get(MODELS, "a/..b/c.d/...")).name == "a/..b/c.d/..."


async def test_rows_older_than_a_bound_stay_readable_alone_and_in_pages(
    catalog: CatalogServer, client: CatalogClient
) -> None:
    await client.create(MODELS, {"name": "first"})  # makes the workspace
    over = {
        MODELS: {"spec": nested(FREE_FORM_DEPTH + 8)},
        VIRTUAL_MODELS: {"default_model": "m", "targets": [{"model_entity": "m"}] * 1000},
        DEPLOYMENTS: {"model": "m", "engine": "mocker", "engine_args": {"prompt": "x" * 200_000}},
    }
    assert catalog.engine is not None
    now = datetime.now(UTC)
    async with catalog.engine.begin() as conn:
        for kind, data in over.items():
            stored = kind.spec.model_construct(**data).model_dump(mode="json", warnings=False)
            await conn.execute(
                kind.table.insert().values(
                    workspace="team-a", name="old", version=1, created_at=now, updated_at=now,
                    data=stored,
                )
            )  # fmt: skip
    for kind in over:
        assert (await client.get(kind, "old")).version == 1
        assert "old" in [item.name for item in await client.list_all(kind)]
    # a patch of other fields is taken (the controller's status writes go on); a patch of the
    # field over the bound must bring it within
    failed = await client.update(DEPLOYMENTS, "old", {"status": "ERROR", "status_message": "x"})
    assert (failed.version, failed.status, len(failed.engine_args["prompt"])) == (
        2,
        "ERROR",
        200_000,
    )
    assert (await client.update(VIRTUAL_MODELS, "old", {"description": "x"})).version == 2
    with pytest.raises(InvalidError) as caught:
        await client.update(VIRTUAL_MODELS, "old", {"targets": [{"model_entity": "m"}] * 101})
    assert caught.value.param == "targets"
    with pytest.raises(InvalidError) as caught:
        await client.update(MODELS, "old", {"spec": {"a": {"b": float("nan")}}})
    assert caught.value.param == "spec.a.b"
    fixed = await client.update(VIRTUAL_MODELS, "old", {"targets": [{"model_entity": "m"}]})
    assert fixed.version == 3


async def test_a_provider_older_than_the_base_url_bound_is_read_and_patched(
    catalog: CatalogServer, client: CatalogClient
) -> None:
    """A provider row with a base_url over 2048 characters (from before the bound) answered
    500 on GET and PATCH (its read model kept the bound; the PATCH was committed first).
    Now it is read as stored and a patch of its other fields is taken; a patch of base_url
    must bring it within."""
    await client.create(MODELS, {"name": "first"})  # makes the workspace
    long_url = "https://llm.example.com/v1?" + "q" * 3000
    assert catalog.engine is not None
    now = datetime.now(UTC)
    async with catalog.engine.begin() as conn:
        await conn.execute(PROVIDERS.table.insert().values(
            workspace="team-a", name="old", version=1, created_at=now, updated_at=now,
            data={"type": "url", "base_url": long_url},
        ))  # fmt: skip
    assert (await client.get(PROVIDERS, "old")).base_url == long_url
    assert "old" in [p.name for p in await client.list_all(PROVIDERS)]
    patched = await client.update(PROVIDERS, "old", {"status": "READY", "status_message": "ok"})
    assert (patched.version, patched.status, patched.base_url) == (2, "READY", long_url)
    with pytest.raises(InvalidError) as caught:
        await client.update(PROVIDERS, "old", {"base_url": long_url + "x"})
    assert caught.value.param == "base_url"


def test_a_stored_row_that_cannot_be_read_is_an_openai_error_not_a_bare_500() -> None:
    from shoal.catalog.errors import CatalogError
    from shoal.catalog.repository import read_as

    with pytest.raises(CatalogError) as caught:
        read_as(PROVIDERS, {"name": "x", "workspace": "w", "version": 1, "type": "nope",
                            "created_at": "2030-01-01T00:00:00Z",
                            "updated_at": "2030-01-01T00:00:00Z"})  # fmt: skip
    assert (caught.value.status, caught.value.code, caught.value.param) == (
        500, "stored_row_unreadable", "type",
    )  # fmt: skip


async def test_engine_args_are_bounded_in_bytes_and_count(client: CatalogClient) -> None:
    base = {"name": "d", "model": "m", "engine": "mocker"}
    for engine_args in (
        {"prompt": "x" * FREE_FORM_BYTES},
        {f"flag-{i}": i for i in range(ENGINE_ARGS_COUNT + 1)},
    ):
        with pytest.raises(InvalidError) as caught:
            await client.create(DEPLOYMENTS, {**base, "engine_args": engine_args})
        assert caught.value.param == "engine_args", caught.value.message
    most = {f"flag-{i}": "x" * 100 for i in range(ENGINE_ARGS_COUNT)}
    await client.create(DEPLOYMENTS, {**base, "engine_args": most})
    with pytest.raises(InvalidError) as caught:
        await client.update(DEPLOYMENTS, "d", {"engine_args": {"prompt": "é" * FREE_FORM_BYTES}})
    assert caught.value.param == "engine_args"


async def test_deployment_names_keep_every_file_and_provider_name_they_make_short(
    client: CatalogClient,
) -> None:
    workspace = "w" * 63
    longest = "d" * DEPLOYMENT_NAME_LENGTH
    body = {"model": "m", "engine": "mocker", "replicas": 10000}
    made = await client.create(DEPLOYMENTS, {"name": longest, **body}, workspace=workspace)
    # the worker log file and the autoprovisioned provider the controller names after it
    assert len(f"{workspace}-{made.name}-{made.replicas}.log".encode()) < 255
    assert len(f"deployment-{made.name}") <= 200
    with pytest.raises(InvalidError) as caught:
        await client.create(DEPLOYMENTS, {"name": longest + "d", **body})
    assert caught.value.param == "name"


async def test_targets_and_base_url_are_bounded_so_a_route_fits_the_store(
    client: CatalogClient,
) -> None:
    targets = [{"model_entity": f"m{i}"} for i in range(TARGETS_LENGTH + 1)]
    with pytest.raises(InvalidError) as caught:
        await client.create(
            VIRTUAL_MODELS, {"name": "vm", "default_model": "m", "targets": targets}
        )
    assert caught.value.param == "targets"
    url = "https://example.com/" + "x" * (BASE_URL_LENGTH - len("https://example.com/") + 1)
    with pytest.raises(InvalidError) as caught:
        await client.create(PROVIDERS, {"name": "p", "type": "url", "base_url": url})
    assert caught.value.param == "base_url"
    # the largest route the API lets a virtual model resolve to, with each target entity
    # served by one url provider whose every field is at its longest, fits the store 3 times
    target = UrlTarget(
        base_url=url[:-1], model="m" * 400, weight=1_000_000, secret="S" * 200,
        provider=f"{'w' * 63}/{'p' * 200}",
    )  # fmt: skip
    route = Route("w" * 63, "v" * 200, (target,) * TARGETS_LENGTH)
    assert 3 * len(route.to_json()) < MAX_VALUE_BYTES


@pytest.mark.parametrize(
    "url",
    [
        "http://admin:pw@host/v1",
        "https://user@host/v1",
        "https://:secret@host:8443/v1",
        "https://a%40b:c@host/v1",
    ],
)
async def test_credentials_in_base_url_are_422_and_never_echoed(
    client: CatalogClient, url: str
) -> None:
    with pytest.raises(InvalidError) as caught:
        await client.create(PROVIDERS, {"name": "p", "type": "url", "base_url": url})
    assert caught.value.param == "base_url" and "auth_secret" in caught.value.message
    assert "pw" not in caught.value.message and "secret@" not in caught.value.message
    await client.create(PROVIDERS, {"name": "p", "type": "url", "base_url": "https://host/v1"})
    with pytest.raises(InvalidError) as caught:
        await client.update(PROVIDERS, "p", {"base_url": url})
    assert caught.value.param == "base_url"
    assert (await client.get(PROVIDERS, "p")).base_url == "https://host/v1"


def test_redact_url_removes_credentials_even_from_urls_urlsplit_refuses() -> None:
    """`shoal catalog serve --db` prints the URL redacted in its one-line error; a URL
    `urlsplit` refuses made that line a traceback (and kept nothing from leaking by luck)."""
    from shoal.urls import redact_url

    assert redact_url("postgresql+asyncpg://u:pw@[::1/db") == "postgresql+asyncpg://***@[::1/db"
    assert redact_url("postgresql://u:p@ss@h:5432/db?x=@") == "postgresql://***@h:5432/db?***"
    assert redact_url("sqlite+aiosqlite:////tmp/a@b.db") == "sqlite+aiosqlite:////tmp/a@b.db"
    assert redact_url("http://h/v1/@team") == "http://h/v1/@team"


def test_body_without_credentials_keeps_an_at_sign_in_its_path() -> None:
    # `@` after the host is a path character, not userinfo
    from shoal.catalog.resources import ProviderSpec

    spec = ProviderSpec(type="url", base_url="https://host/v1/@team")
    assert spec.base_url == "https://host/v1/@team"
    assert json.loads(spec.model_dump_json())["base_url"] == "https://host/v1/@team"


async def test_a_patch_that_breaks_a_rule_across_fields_is_still_422(client: CatalogClient) -> None:
    await client.create(PROVIDERS, {"name": "p", "type": "url", "base_url": "https://host/v1"})
    with pytest.raises(InvalidError) as caught:
        await client.update(PROVIDERS, "p", {"type": "fleet"})
    assert caught.value.param == "base_url"
    assert (await client.get(PROVIDERS, "p")).type == "url"


async def test_a_body_over_the_byte_bound_is_413_before_it_is_read(
    catalog: CatalogServer,
) -> None:
    """A declared length over `MAX_BODY_BYTES` is answered 413 in the catalog's error format
    from the headers alone (the body never comes), so no request makes it buffer more."""
    reader, writer = await asyncio.open_connection("127.0.0.1", catalog.port)
    try:
        writer.write(
            b"POST /v1/workspaces/team-a/models HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode()
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        body = json.loads(await asyncio.wait_for(reader.readexactly(length), 5))
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 413 ")
    assert body["error"]["code"] == "body_too_large"
    assert str(MAX_BODY_BYTES) in body["error"]["message"]


async def test_a_chunked_body_over_the_byte_bound_is_413_once_it_passes_it(
    client: CatalogClient,
) -> None:
    """Without a length, the body is counted as it comes: 413 as soon as it passes the bound,
    while the sender still has more to send."""
    never = asyncio.Event()

    async def chunks() -> Any:
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536
        await never.wait()  # the rest never comes: only an early answer ends the test

    url = f"{client.base_url}/v1/workspaces/{client.workspace}/models"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=chunks(), headers={"Content-Type": "application/json"}) as resp,
    ):
        answer = await asyncio.wait_for(resp.json(content_type=None), 5)
    assert resp.status == 413 and answer["error"]["code"] == "body_too_large"
    status, _ = await send(client, "POST", "models", '{"name": "m"}' + " " * 100_000)
    assert status == 201  # a body under the bound is served as before


async def test_a_large_body_decoded_off_the_loop_is_refused_as_a_small_one_is(
    client: CatalogClient,
) -> None:
    """Bodies over `api.OFF_LOOP_BYTES` are decoded and validated in a thread: the same
    answers as on the loop (400 saying where, 400 for depth, 422 naming the field)."""
    from shoal.catalog.api import OFF_LOOP_BYTES

    pad = " " * OFF_LOOP_BYTES
    status, error = await send(client, "POST", "models", pad + '{"name": "m",\n "spec": {,}}')
    assert (status, error["param"]) == (400, None) and "line 2 column 11" in error["message"]
    status, error = await send(client, "POST", "models", pad + json.dumps(nested(MAX_DEPTH + 1)))
    assert (status, error["param"]) == (400, None) and "nested deeper" in error["message"]
    status, error = await send(client, "POST", "models", '{"name": "m", "spec": 1}' + pad)
    assert (status, error["param"]) == (422, "spec"), error
    status, error = await send(client, "POST", "models", '{"name": "m", "spec": {"a": 1}}' + pad)
    assert status == 201, error
    assert (await client.get(MODELS, "m")).spec == {"a": 1}
    status, error = await send(client, "PATCH", "models/m", '{"description": "d"}' + pad)
    assert status == 200, error
    assert (await client.get(MODELS, "m")).description == "d"


@pytest.mark.parametrize(
    "body",
    [b'{"name": "m\xff"}', b"\xef\xbb\xbf{}", b'{"name": "\xed\xa0\x80"}', b"\xff\xfe{\x00}\x00"],
    ids=["invalid-utf8", "bom", "utf8-surrogate", "utf16"],
)
async def test_a_large_body_that_is_not_utf8_json_is_answered_as_a_small_one(
    client: CatalogClient, body: bytes
) -> None:
    """Bytes `json.loads` refuses before it parses (not UTF-8, a BOM, UTF-16): a body over
    `api.OFF_LOOP_BYTES` gets the answer a small one gets, never 500."""
    from shoal.catalog.api import OFF_LOOP_BYTES

    space = " ".encode("utf-16-le" if body.startswith(b"\xff\xfe") else "utf-8")
    small = await send(client, "POST", "models", body)
    large = await send(client, "POST", "models", body + space * OFF_LOOP_BYTES)
    assert small[0] in (400, 422), small
    assert large == small


async def test_a_large_body_without_the_admin_token_is_401_before_it_is_decoded(
    database_url: str,
) -> None:
    """The admin token is checked before a body over `api.OFF_LOOP_BYTES` is decoded and
    validated (in a thread): a client without it gets 401 as with a small body, never a
    422 about the body, and costs no decoding."""
    from shoal.catalog.api import OFF_LOOP_BYTES

    server = CatalogServer(CatalogConfig(database_url, port=0, admin_token="s3cret"))
    await server.start()
    try:
        url = f"{server.url}/v1/workspaces/team-a/models"
        pad = " " * OFF_LOOP_BYTES
        answers = []
        async with aiohttp.ClientSession() as session:
            for body in ('{"name": "m", "spec": 1}', '{"name": "m", "spec": 1}' + pad,
                         '{"name": "m", "spec": {,}}' + pad):  # fmt: skip
                async with session.post(
                    url, data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    answers.append((resp.status, (await resp.json())["error"]["code"]))
    finally:
        await server.stop()
    assert answers[0][0] == 401
    assert answers[1:] == [answers[0]] * 2, answers


async def test_large_bodies_are_decoded_one_at_a_time_beside_the_shared_thread_pool(
    client: CatalogClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client sending many bodies over `api.OFF_LOOP_BYTES` at once gets them decoded one
    after the other on the catalog's own thread: not in the pool usage reports use, nor in
    six threads at once that would leave the event loop (every other client) a seventh of
    the interpreter."""
    import threading

    from shoal.catalog import api

    decoding: list[int] = []
    seen: list[tuple[str, int]] = []
    real = api._decoded

    def decoded(body: bytes, field: Any) -> Any:
        decoding.append(1)
        seen.append((threading.current_thread().name, len(decoding)))
        try:
            threading.Event().wait(0.02)  # (work: lets another decoding overlap if it may)
            return real(body, field)
        finally:
            decoding.pop()

    monkeypatch.setattr(api, "_decoded", decoded)
    pad = " " * api.OFF_LOOP_BYTES
    answers = await asyncio.gather(
        *(send(client, "POST", "models", f'{{"name": "m{i}"}}' + pad) for i in range(8))
    )
    assert [status for status, _ in answers] == [201] * 8
    assert len(seen) == 8
    assert {name.split("_")[0] for name, _ in seen} == {"catalog-body"}, seen
    assert max(depth for _, depth in seen) == 1, seen
