"""The `openai` sidecar engine against a small real OpenAI-compatible server in-process
(`tests.worker.engines.fake_upstream`, standing in for vLLM)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from shoal.worker.engine import EngineUnavailableError
from shoal.worker.engines.openai_sidecar import OpenAISidecarEngine, normalize_upstream
from tests.helpers import LoopTurns, Server, free_port, serving, wait_for
from tests.worker.engines.fake_upstream import MODEL, STREAM, FakeUpstream
from tests.worker.engines.support import client_for, engine_served


def sidecar(upstream_url: str) -> AbstractAsyncContextManager[tuple[OpenAISidecarEngine, Server]]:
    """A started sidecar for `upstream_url`, its app served on a free port."""
    return engine_served(OpenAISidecarEngine(upstream_url, health_interval=0.0))


@asynccontextmanager
async def streamed_chat(server: Server) -> AsyncIterator[aiohttp.ClientResponse]:
    """A raw streamed chat request to `server`, open for the block."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{server.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [], "stream": True},
        ) as response,
    ):
        yield response


async def names_of(engine: OpenAISidecarEngine) -> list[str]:
    return [model.name for model in await engine.served_models()]


async def test_models_are_listed_while_healthy_withdrawn_while_down_and_back_after(
    fake: FakeUpstream,
) -> None:
    engine = OpenAISidecarEngine(f"{fake.server.url}/v1/", health_interval=0.0)
    await engine.start()
    try:
        base, adapter = await engine.served_models()
        assert (base.name, base.source, base.context_length) == (
            MODEL,
            f"openai:{MODEL}",
            8192,
        )
        assert (base.adapter, base.base_model) == (None, None)
        assert (adapter.name, adapter.adapter, adapter.base_model) == (
            "sql-lora",
            "sql-lora",
            MODEL,
        )
        assert adapter.context_length == 4096  # not reported by the server: the default
        await engine.check_health()

        await fake.server.stop()
        assert await engine.served_models() == []
        with pytest.raises(EngineUnavailableError, match=r"GET http://.*/health failed"):
            await engine.check_health()

        await fake.server.start()
        assert await names_of(engine) == [MODEL, "sql-lora"]
        await engine.check_health()
    finally:
        await engine.stop()


async def test_an_unhealthy_upstream_announces_nothing_and_says_why(fake: FakeUpstream) -> None:
    fake.health_status = 503
    engine = OpenAISidecarEngine(fake.server.url, health_interval=0.0)
    await engine.start()  # a server still loading is not a start failure
    try:
        assert await engine.served_models() == []
        with pytest.raises(EngineUnavailableError, match=r"GET http://.*/health answered 503"):
            await engine.check_health()
        fake.health_status = 200
        assert await names_of(engine) == [MODEL, "sql-lora"]
    finally:
        await engine.stop()


async def test_a_server_without_health_route_is_probed_by_its_model_list() -> None:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "llama3.2:1b"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serving(app) as ollama:
        engine = OpenAISidecarEngine(ollama.url, health_interval=0.0)
        await engine.start()
        try:
            await engine.check_health()
            assert await names_of(engine) == ["llama3.2:1b"]
        finally:
            await engine.stop()


async def test_health_checks_only_get_health_and_models_never_generate(
    fake: FakeUpstream,
) -> None:
    engine = OpenAISidecarEngine(fake.server.url, health_interval=0.0)
    await engine.start()
    try:
        for _ in range(3):
            await engine.check_health()
            await engine.served_models()
    finally:
        await engine.stop()
    assert len(fake.requests) == 2 * 7  # start probes once, then six more probes
    assert set(fake.requests) == {("GET", "/health"), ("GET", "/v1/models")}


async def test_probes_are_cached_for_the_health_interval(fake: FakeUpstream) -> None:
    engine = OpenAISidecarEngine(fake.server.url, health_interval=60.0)
    await engine.start()
    try:
        for _ in range(5):
            await engine.check_health()
            assert await names_of(engine) == [MODEL, "sql-lora"]
    finally:
        await engine.stop()
    assert fake.requests == [("GET", "/health"), ("GET", "/v1/models")]


async def test_a_stream_crosses_the_sidecar_chunk_by_chunk_unchanged(fake: FakeUpstream) -> None:
    async with sidecar(fake.server.url) as (engine, server):
        fake.gate.release()
        received: list[str | None] = []
        async with client_for(server) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            async for chunk in stream:
                # The upstream has sent exactly this chunk and waits: it came on its own.
                assert fake.chunks_sent == len(received) + 1
                assert engine.in_flight == 1
                received.append(chunk.choices[0].delta.content)
                fake.gate.release()
        assert received == ["Hello", ", ", "world"]
        await wait_for(lambda: engine.in_flight == 0, message="the request to finish")

        # Byte for byte, with the upstream's content type.
        for _ in STREAM:
            fake.gate.release()
        async with streamed_chat(server) as response:
            assert response.status == 200
            assert response.content_type == "text/event-stream"
            assert await response.read() == b"".join(STREAM)


async def test_a_plain_response_keeps_status_content_type_and_body(fake: FakeUpstream) -> None:
    async with (
        sidecar(fake.server.url) as (_, server),
        aiohttp.ClientSession() as http,
    ):
        body = b'{"model": "fake/model-7b", "messages": [{"role": "user", "content": "hi"}]}'
        async with http.post(
            f"{server.url}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        ) as response:
            assert response.status == 201
            assert response.content_type == "application/json"
            assert (await response.json())["choices"][0]["message"]["content"] == "Hello"
        async with http.get(f"{server.url}/v1/models") as response:
            assert [m["id"] for m in (await response.json())["data"]] == [MODEL, "sql-lora"]

        async with client_for(server) as client:
            completion = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        assert completion.choices[0].message.content == "Hello"
        assert completion.usage is not None and completion.usage.total_tokens == 4


async def test_an_unreachable_upstream_answers_502_in_openai_error_format() -> None:
    async with (
        sidecar(f"http://127.0.0.1:{free_port()}") as (engine, server),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(
            f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": []}
        ) as response:
            assert response.status == 502
            error = (await response.json())["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "upstream_unavailable"
        assert "unreachable" in error["message"]

        async with client_for(server) as client:
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}]
                )
        assert caught.value.status_code == 502
        assert engine.in_flight == 0


async def test_a_client_disconnect_cancels_the_upstream_request(fake: FakeUpstream) -> None:
    fake.hang_after_first_chunk = True
    fake.gate.release()
    async with sidecar(fake.server.url) as (engine, server):
        async with streamed_chat(server) as response:
            assert await response.content.readuntil(b"\n\n") == STREAM[0]
            assert engine.in_flight == 1
        # The client is gone: the upstream's handler is cancelled, nothing is in flight.
        await wait_for(fake.stream_cancelled.is_set, message="the upstream to be cancelled")
        await wait_for(lambda: engine.in_flight == 0, message="in_flight to drop to zero")


async def test_an_upstream_failing_mid_stream_truncates_the_client_response() -> None:
    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(STREAM[0])
        assert request.transport is not None
        request.transport.abort()  # the upstream dies mid-response
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with (
        serving(app) as upstream,
        sidecar(upstream.url) as (engine, server),
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}/v1/chat/completions", json={"stream": True}) as response,
    ):
        assert await response.content.readuntil(b"\n\n") == STREAM[0]
        # Never a clean end of stream: the client can tell the answer is incomplete.
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    assert engine.in_flight == 0


def test_upstream_urls_are_normalized_to_the_server_root() -> None:
    assert normalize_upstream("http://gpu-1:8000/v1/") == "http://gpu-1:8000"
    assert normalize_upstream("http://gpu-1:8000") == "http://gpu-1:8000"
    assert normalize_upstream("https://host/ollama/v1") == "https://host/ollama"
    with pytest.raises(ValueError, match="http"):
        normalize_upstream("gpu-1:8000")


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def test_the_client_authorization_never_reaches_the_upstream_only_the_configured_key(
    fake: FakeUpstream,
) -> None:
    client_auth = {"Authorization": "Bearer the-client-s-own-key"}
    async with sidecar(fake.server.url) as (_, server), aiohttp.ClientSession() as http:
        fake.authorizations.clear()
        async with http.post(
            f"{server.url}/v1/chat/completions", json=CHAT, headers=client_auth
        ) as response:
            assert response.status == 201
        assert fake.authorizations == [None]

    fake.api_key = "upstream-key"
    keyed = OpenAISidecarEngine(fake.server.url, health_interval=0.0, api_key="upstream-key")
    async with engine_served(keyed) as (engine, server), aiohttp.ClientSession() as http:
        assert await names_of(engine) == [MODEL, "sql-lora"]
        fake.authorizations.clear()
        async with http.post(
            f"{server.url}/v1/chat/completions", json=CHAT, headers=client_auth
        ) as response:
            assert response.status == 201
        assert fake.authorizations == ["Bearer upstream-key"]


def redirecting_upstream(
    status: int, path: str, location: str | None = None
) -> tuple[web.Application, list[str]]:
    """An upstream whose `path` answers `status` to `/moved{path}` (or `location`); requests
    that follow the redirect are recorded (and answered as vLLM answers a bodiless POST turned
    into a GET)."""
    followed: list[str] = []

    async def redirect(request: web.Request) -> web.Response:
        return web.Response(status=status, headers={"Location": location or f"/moved{path}"})

    async def moved(request: web.Request) -> web.Response:
        followed.append(f"{request.method} {request.path}")
        if request.path.endswith("/completions") and not await request.read():
            return web.json_response({"error": {"message": "empty body"}}, status=400)
        return web.json_response({"data": [{"id": MODEL}]})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL}]})

    app = web.Application()
    app.router.add_route("*", path, redirect)
    app.router.add_route("*", f"/moved{path}", moved)
    if path != "/v1/models":
        app.router.add_get("/v1/models", models)
    return app, followed


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_a_redirect_on_the_request_path_is_not_followed_and_answers_502(
    status: int,
) -> None:
    app, followed = redirecting_upstream(status, "/v1/chat/completions")
    async with (
        serving(app) as upstream,
        sidecar(upstream.url) as (engine, server),
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}/v1/chat/completions", json=CHAT) as response,
    ):
        assert response.status == 502
        error = (await response.json())["error"]
    assert error["code"] == "upstream_redirect"
    assert f"{status}" in error["message"]
    assert f"{upstream.url}/moved/v1/chat/completions" in error["message"]
    assert followed == []  # never turned into a bodiless GET, never re-sent elsewhere
    assert engine.in_flight == 0


async def test_a_redirect_on_the_health_probe_is_reported_not_followed() -> None:
    app, followed = redirecting_upstream(301, "/health")
    async with serving(app) as upstream:
        engine = OpenAISidecarEngine(upstream.url, health_interval=0.0)
        await engine.start()
        try:
            assert await engine.served_models() == []
            with pytest.raises(
                EngineUnavailableError,
                match=rf"GET {upstream.url}/health redirected \(301\) to "
                rf"{upstream.url}/moved/health: .*--upstream",
            ):
                await engine.check_health()
        finally:
            await engine.stop()
    assert followed == []


SECRET_LOCATION = "https://sso:pw-s3cret@login.example/authorize?client_secret=s3cret&state=1"


async def test_a_redirect_is_reported_without_the_secrets_of_where_it_points() -> None:
    """An upstream behind a login proxy answers with a redirect whose URL carries credentials
    or a signed query: `/health` (read without a token), the logs and a client's 502 named
    it whole."""
    app, _ = redirecting_upstream(302, "/health", SECRET_LOCATION)
    async with serving(app) as upstream:
        engine = OpenAISidecarEngine(upstream.url, health_interval=0.0)
        await engine.start()
        try:
            with pytest.raises(EngineUnavailableError) as raised:
                await engine.check_health()
        finally:
            await engine.stop()
    assert "login.example/authorize" in str(raised.value)
    assert "s3cret" not in str(raised.value)

    app, _ = redirecting_upstream(307, "/v1/chat/completions", SECRET_LOCATION)
    async with (
        serving(app) as upstream,
        sidecar(upstream.url) as (engine, server),
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}/v1/chat/completions", json=CHAT) as response,
    ):
        assert response.status == 502
        message = (await response.json())["error"]["message"]
    assert "login.example/authorize" in message and "s3cret" not in message


async def test_only_the_model_named_is_announced_with_its_adapters(fake: FakeUpstream) -> None:
    fake.model_ids = ["other-model", MODEL]
    engine = OpenAISidecarEngine(fake.server.url, model=MODEL, health_interval=0.0)
    await engine.start()
    try:
        assert await names_of(engine) == [MODEL, "sql-lora"]
        await engine.check_health()
    finally:
        await engine.stop()


async def test_a_model_the_upstream_does_not_list_is_not_announced_and_unhealthy_says_why(
    fake: FakeUpstream,
) -> None:
    fake.model_ids = ["other-model"]
    engine = OpenAISidecarEngine(fake.server.url, model="wanted", health_interval=0.0)
    await engine.start()
    try:
        assert await engine.served_models() == []
        with pytest.raises(
            EngineUnavailableError,
            match=r"does not list 'wanted' \(it lists 2 models: 'other-model', 'sql-lora'\)",
        ):
            await engine.check_health()
        fake.model_ids = ["other-model", "wanted"]  # the upstream loads it later: announced
        assert await names_of(engine) == ["wanted"]
        await engine.check_health()
    finally:
        await engine.stop()


async def test_a_model_has_the_same_source_whichever_upstream_serves_it(
    fake: FakeUpstream,
) -> None:
    other = FakeUpstream()
    await other.server.start()
    try:
        sources = []
        for upstream in (fake, other):
            engine = OpenAISidecarEngine(upstream.server.url, model=MODEL, health_interval=0.0)
            await engine.start()
            try:
                sources.append([(m.name, m.source) for m in await engine.served_models()])
            finally:
                await engine.stop()
    finally:
        await other.server.stop()
    assert fake.server.url != other.server.url
    assert sources[0] == sources[1]


async def test_a_2_mib_chat_is_forwarded_byte_for_byte_and_one_over_the_limit_gets_413(
    fake: FakeUpstream,
) -> None:
    engine = OpenAISidecarEngine(fake.server.url, health_interval=0.0, max_body=3 * 1024 * 1024)
    content = "word " * (2 * 1024 * 1024 // 5)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})
    async with engine_served(engine) as (_, server), aiohttp.ClientSession() as http:
        async with http.post(
            f"{server.url}/v1/chat/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        ) as response:
            assert response.status == 201
        assert fake.bodies == [body.encode()]
        async with http.post(
            f"{server.url}/v1/chat/completions",
            data=b" " * (3 * 1024 * 1024 + 1),
            headers={"Content-Type": "application/json"},
        ) as response:
            assert response.status == 413
            assert (await response.json())["error"]["message"]
    assert len(fake.bodies) == 1


def test_the_sidecar_takes_the_gateways_16_mib_by_default() -> None:
    assert OpenAISidecarEngine("http://127.0.0.1:1").max_body == 16 * 1024 * 1024


def test_an_upstream_url_with_credentials_is_refused_without_echoing_them() -> None:
    with pytest.raises(ValueError, match="--upstream-api-key") as caught:
        normalize_upstream("http://admin:s3cret-PW@gpu-1:8000/v1")
    assert "s3cret-PW" not in str(caught.value)
    with pytest.raises(ValueError, match="--upstream-api-key"):
        normalize_upstream("http://token@gpu-1:8000")


@pytest.mark.parametrize(
    "url", ["http://gpu-1:8000/v1?api-key=s3cret-PW", "ftp://gpu-1/?token=s3cret-PW"]
)
def test_an_upstream_url_with_a_query_is_refused_without_echoing_it(url: str) -> None:
    """A key put in the URL's query was dropped without a word (the upstream then answered
    401), and a URL refused for its scheme was echoed whole, its query with it, to stderr."""
    with pytest.raises(ValueError) as caught:
        normalize_upstream(url)
    assert "s3cret-PW" not in str(caught.value)


async def test_a_deeply_nested_model_list_makes_the_upstream_unhealthy_naming_it() -> None:
    """A reply nested 100,000 deep raised RecursionError out of the probe (only ValueError
    was caught): now the upstream is unhealthy, and the reason names it."""
    nested = b'{"data": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}"

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=nested, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    async with serving(app) as upstream:
        engine = OpenAISidecarEngine(upstream.url, health_interval=0.0)
        await engine.start()
        try:
            assert await engine.served_models() == []
            with pytest.raises(
                EngineUnavailableError,
                match=rf"GET {upstream.url}/v1/models failed: .*nested deeper than 64",
            ):
                await engine.check_health()
        finally:
            await engine.stop()


def listing_app(body: bytes, *, chunked: bool = False) -> web.Application:
    """An upstream answering `/health` 200 and `/v1/models` with `body`."""

    async def models(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=body, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(body), 1 << 20):
            await response.write(body[start : start + (1 << 20)])
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def listing(count: int, name_chars: int = 20) -> bytes:
    data = [{"id": f"m-{i:06d}-" + "x" * name_chars, "object": "model"} for i in range(count)]
    return json.dumps({"object": "list", "data": data}).encode()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_model_listing_over_4_mib_makes_the_upstream_unhealthy_naming_the_bound(
    chunked: bool,
) -> None:
    """`/v1/models` was read whole, however large (a 16 MB listing was read, decoded and parsed
    on the event loop every 2 s). Past 4 MiB it is refused: unhealthy, nothing announced."""
    from shoal.worker.engines.openai_sidecar import MAX_MODELS_BODY

    body = listing(12_000, name_chars=400)
    assert len(body) > MAX_MODELS_BODY
    async with serving(listing_app(body, chunked=chunked)) as upstream:
        engine = OpenAISidecarEngine(upstream.url, health_interval=0.0)
        await engine.start()
        try:
            assert await engine.served_models() == []
            with pytest.raises(EngineUnavailableError, match=r"answered more than 4,194,304 bytes"):
                await engine.check_health()
        finally:
            await engine.stop()


async def test_a_large_model_listing_is_decoded_a_slice_of_bytes_a_turn_on_the_loop() -> None:
    """A listing over 64 KiB was decoded in a thread, which held the event loop as long:
    msgspec decodes in one C call holding the GIL. Now its entries are decoded at most
    `PARSE_SLICE_BYTES` a turn of the loop, all on it, and the models are those listed."""
    from shoal import slices
    from shoal.worker.engines import openai_sidecar

    limit = openai_sidecar.PARSE_SLICE_BYTES
    large = listing(20_000)
    assert len(large) > 10 * limit
    async with serving(listing_app(large)) as upstream:
        engine = OpenAISidecarEngine(upstream.url, health_interval=0.0)
        turns = LoopTurns()
        turns.wrap(slices, "decode_slice", lambda raws, *_: sum(map(len, raws)))
        await engine.start()
        try:
            models = await engine.served_models()
        finally:
            await engine.stop()
            await turns.stop()
    assert [m.name for m in models] == [e["id"] for e in json.loads(large)["data"]]
    assert turns.off_loop == 0 and turns.on_loop > len(large) // 2
    assert turns.most_per_turn <= limit, f"{turns.most_per_turn} bytes decoded in one turn"


async def test_a_model_missing_upstream_names_ten_listed_models_and_the_count_not_every_one() -> (
    None
):
    """With `--model X` missing upstream, the reason (in /health and the log) named every
    model the upstream lists: 8.2 MB for 20,000. Now it names the first ten, each cut to a
    bounded length, and how many more there are."""
    body = listing(10_000, name_chars=300)
    async with serving(listing_app(body)) as upstream:
        engine = OpenAISidecarEngine(upstream.url, model="not-listed", health_interval=0.0)
        await engine.start()
        try:
            with pytest.raises(EngineUnavailableError) as raised:
                await engine.check_health()
        finally:
            await engine.stop()
    reason = str(raised.value)
    assert "does not list 'not-listed'" in reason, reason
    assert len(reason) < 4096, len(reason)
    assert "it lists 10,000 models: 'm-000000-" in reason, reason
    assert "and 9,990 more" in reason, reason
    assert "m-000009-" in reason and "m-000010-" not in reason, reason


async def test_an_unchanged_listing_is_served_as_the_very_same_models_so_a_sync_skips_it() -> None:
    """Each probe of `/v1/models` made new `ServedModel`s, so the endpoint's sync (which skips
    a list of the same objects as its last one) compared 3,000 adapters in full every 2 s.
    A model listed as before is served as the object held; a changed one is new."""
    state = {"body": listing(50)}

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=state["body"], content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    async with serving(app) as upstream:
        engine = OpenAISidecarEngine(upstream.url, health_interval=0.0)
        await engine.start()
        try:
            first = await engine.served_models()
            again = await engine.served_models()
            assert len(first) == 50 and all(a is b for a, b in zip(first, again, strict=True))
            data = json.loads(state["body"])
            data["data"][7]["max_model_len"] = 1234
            state["body"] = json.dumps(data).encode()
            changed = await engine.served_models()
            assert changed[7] is not first[7] and changed[7].context_length == 1234
            assert all(changed[i] is first[i] for i in range(50) if i != 7)
        finally:
            await engine.stop()


async def test_an_unchanged_listing_is_not_decoded_again_and_a_changed_one_is_compared_in_slices() -> (
    None
):
    """After the decode in a thread, every listed model was compared with the one held on
    the event loop: 60,000 adapters held it ~175 ms each 2 s probe. A listing of the very
    bytes of the last one is neither decoded nor compared now (its models are the ones
    held), and a changed large one is compared `PARSE_SLICE_ENTRIES` models a turn."""
    from shoal.worker.engines.openai_sidecar import PARSE_SLICE_ENTRIES

    state = {"body": listing(5_000)}

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=state["body"], content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    async with serving(app) as upstream:
        engine = OpenAISidecarEngine(upstream.url, health_interval=0.0)
        decoded = 0
        decode = engine._decode_models

        def counted_decode(*args: Any) -> Any:
            nonlocal decoded
            decoded += 1
            return decode(*args)

        engine._decode_models = counted_decode  # type: ignore[method-assign,assignment]
        # (each entry parsed is compared with the model held under its name)
        compared = LoopTurns().wrap(engine, "_parse_models", lambda data, *_: len(data))
        await engine.start()
        try:
            first = await engine.served_models()
            assert decoded == 1 and len(first) == 5_000 and compared.on_loop == 5_000
            for _ in range(3):
                again = await engine.served_models()
                assert all(a is b for a, b in zip(first, again, strict=True))
            assert (decoded, compared.on_loop) == (1, 5_000)

            data = json.loads(state["body"])
            data["data"][7]["max_model_len"] = 1234
            state["body"] = json.dumps(data).encode()
            changed = await engine.served_models()
            assert decoded == 2 and compared.on_loop == 10_000
            assert compared.most_per_turn <= PARSE_SLICE_ENTRIES
            assert changed[7] is not first[7] and changed[7].context_length == 1234
            assert all(changed[i] is first[i] for i in range(5_000) if i != 7)
        finally:
            await engine.stop()
            await compared.stop()


async def test_a_changed_listing_makes_new_model_objects_only_for_the_models_that_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What was wrong: each change of a large listing made a new model object for every
    entry (in the decode's thread), then kept the held one of each model listed as before:
    20,000 objects made and dropped per change, which set off full garbage collections of
    the worker's ~130,000 objects (90-210 ms of the event loop's time, the GIL held). What
    holds now: a model listed as held is the held object itself; only a new or changed
    one is made."""
    from shoal.worker.engines import openai_sidecar

    made = LoopTurns().wrap(openai_sidecar, "ServedModel")
    state = {"body": listing(5_000)}

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=state["body"], content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    try:
        async with serving(app) as upstream:
            engine = OpenAISidecarEngine(upstream.url, health_interval=0.0)
            await engine.start()
            try:
                first = await engine.served_models()
                assert made.on_loop + made.off_loop == 5_000
                data = json.loads(state["body"])
                data["data"][7]["max_model_len"] = 1234
                data["data"].append({"id": "new-one", "object": "model"})
                state["body"] = json.dumps(data).encode()
                changed = await engine.served_models()
            finally:
                await engine.stop()
    finally:
        await made.stop()
    assert made.on_loop + made.off_loop == 5_000 + 2  # the changed one and the new one
    assert changed[7] is not first[7] and changed[7].context_length == 1234
    assert all(changed[i] is first[i] for i in range(5_000) if i != 7)
    assert changed[-1].name == "new-one"
