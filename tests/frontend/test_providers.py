"""What reaches an external provider (a virtual model's `url` target) and what comes back from
it: an allow-list of the client's headers, the gateway's CORS policy alone, a loop of url
targets stopped at its first turn, and failover between targets that share a base URL."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import openai
from aiohttp import web

from shoal.discovery import Route, UrlTarget, publish_route
from shoal.frontend import Frontend
from shoal.frontend.proxy.headers import MAX_GATEWAY_HOPS, PROVIDER_HEADERS
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, openai_client
from tests.frontend.support import FakeWorker
from tests.helpers import wait_for

CHAT = [{"role": "user", "content": "hi"}]
ORIGIN = "https://app.example.com"


class Provider(FakeWorker):
    """A fake provider that answers 500 for the models in `failing_models` and adds
    `extra_headers` (a provider's own CORS headers) to its answers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failing_models: set[str] = set()
        self.refusing: dict[str, int] = {}  # model -> the 401 or 403 it is answered
        self.extra_headers: dict[str, str] = {}
        self.served: list[str] = []

    def _failing(self) -> web.Response | None:
        model = json.loads(self.bodies[-1])["model"]
        if model in self.refusing:
            error = {"message": f"access to model {model} denied", "type": "permission_error"}
            return web.json_response({"error": error}, status=self.refusing[model])
        if model in self.failing_models:
            return web.json_response(
                {"error": {"message": "down", "type": "server_error"}}, status=500
            )
        self.served.append(model)
        return super()._failing()

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        response = await super()._generate(request, kind)
        if not response.prepared:
            response.headers.update(self.extra_headers)
        return response


async def provider(*args: Any, **kwargs: Any) -> Provider:
    started = await Provider(*args, **kwargs).start()
    return started


def url_target(base: str, model: str, **kwargs: Any) -> UrlTarget:
    return UrlTarget(base_url=f"{base}/v1", model=model, **kwargs)


async def serve_route(store: Store, frontend: Frontend, name: str, *targets: UrlTarget) -> None:
    await publish_route(store, Route(workspace="default", name=name, targets=targets))
    await wait_for(
        lambda: (vm := frontend.routes.models.get(name)) is not None and vm.serving,
        message=f"route {name} served",
    )


async def test_a_provider_gets_only_the_allowed_client_headers(
    store: Store, start_frontend: StartFrontend
) -> None:
    remote = await provider("remote-model")
    try:
        frontend = await start_frontend()
        await serve_route(store, frontend, "r", url_target(remote.url, "remote-model"))
        client = openai_client(
            frontend,
            organization="org-of-the-client",
            project="proj-of-the-client",
            default_headers={
                "Cookie": "session=secret",
                "X-Forwarded-User": "alice@example.com",
                "X-Forwarded-For": "10.0.0.7",
                "Origin": ORIGIN,
                "Referer": f"{ORIGIN}/private/page",
                "X-Request-Id": "req-123",
                "OpenAI-Beta": "assistants=v2",
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            },
        )
        reply = await client.chat.completions.create(model="r", messages=CHAT)  # type: ignore[arg-type]
        assert reply.model == "remote-model"
        seen = remote.headers[-1]
        names = {name.lower() for name in seen}
        allowed = {name.decode() for name in PROVIDER_HEADERS}
        allowed |= {"host", "content-length", "accept-encoding"}  # (the gateway's own)
        assert names <= allowed, names - allowed
        for leak in ("cookie", "x-forwarded-user", "x-forwarded-for", "origin", "referer"):
            assert leak not in names
        assert "openai-organization" not in names and "openai-project" not in names
        assert seen["x-request-id"] == "req-123"
        assert seen["openai-beta"] == "assistants=v2"
        assert seen["traceparent"].startswith("00-0af7651916cd43dd")
        assert seen["content-type"] == "application/json"
        assert seen["user-agent"].startswith("AsyncOpenAI/Python")
        assert seen["via"] == f"1.1 {frontend.proxy.gateway}"
        assert seen["accept-encoding"] == "identity"  # (the client's `gzip` is not asked for)
    finally:
        await remote.stop()


async def post_from(frontend: Frontend, model: str, origin: str) -> tuple[int, list[str]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{frontend.url}/v1/chat/completions",
            json={"model": model, "messages": CHAT},
            headers={"Origin": origin},
        ) as response,
    ):
        await response.read()
        return response.status, response.headers.getall("access-control-allow-origin", [])


async def test_a_providers_cors_headers_are_dropped_so_the_gateways_policy_alone_decides(
    store: Store, start_frontend: StartFrontend
) -> None:
    remote = await provider("remote-model")  # vLLM's default: any origin may read
    remote.extra_headers = {
        "Access-Control-Allow-Origin": "*",
        "Access-Control-Allow-Credentials": "true",
    }
    try:
        with_cors = await start_frontend(cors_origins=(ORIGIN,))
        without_cors = await start_frontend()
        target = url_target(remote.url, "remote-model")
        await serve_route(store, with_cors, "r", target)
        await wait_for(lambda: "r" in without_cors.routes.models)
        assert await post_from(with_cors, "r", ORIGIN) == (200, [ORIGIN])
        assert await post_from(without_cors, "r", "https://evil.example") == (200, [])
    finally:
        await remote.stop()


async def test_a_url_target_pointing_back_at_its_frontend_is_answered_508_at_once(
    store: Store, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(max_connections=64, first_byte_timeout=5)
    assert frontend.server is not None
    await serve_route(store, frontend, "loop", url_target(frontend.url, "loop"))
    started = time.monotonic()
    client = openai_client(frontend)
    try:
        await client.chat.completions.create(model="loop", messages=CHAT)  # type: ignore[arg-type]
        raise AssertionError("a looping request was answered")
    except openai.APIStatusError as exc:
        assert exc.status_code == 508
        assert exc.code == "loop_detected"
        assert frontend.proxy.gateway in exc.message and "loop" in exc.message
    assert time.monotonic() - started < 2
    await client.close()
    # One request cost the client's connection and one hop back in: nothing piles up.
    await wait_for(lambda: len(frontend.server.connections) <= 1)  # type: ignore[union-attr]
    assert len(frontend.routes.models["loop"].choices[0].upstream.idle) <= 1  # type: ignore[union-attr]


async def test_a_loop_through_two_frontends_is_answered_508(
    store: Store, start_frontend: StartFrontend
) -> None:
    one = await start_frontend(max_connections=64, first_byte_timeout=5, workspaces=("one",))
    two = await start_frontend(max_connections=64, first_byte_timeout=5, workspaces=("two",))
    for frontend, workspace, other in ((one, "one", two), (two, "two", one)):
        await publish_route(
            store, Route(workspace=workspace, name="ping", targets=(url_target(other.url, "ping"),))
        )
        await wait_for(lambda f=frontend: "ping" in f.routes.models)  # type: ignore[misc]
    try:
        await openai_client(one).chat.completions.create(model="ping", messages=CHAT)  # type: ignore[arg-type]
        raise AssertionError("a looping request was answered")
    except openai.APIStatusError as exc:
        assert (exc.status_code, exc.code) == (508, "loop_detected")
        assert one.proxy.gateway in exc.message  # it came back to the first one
    assert two.server is not None and len(two.server.connections) <= 1


async def test_a_request_through_too_many_gateways_is_answered_508(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend()
    trail = ", ".join(f"1.1 shoal-{i:016x}" for i in range(MAX_GATEWAY_HOPS))
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{frontend.url}/v1/chat/completions",
            json={"model": "anything", "messages": CHAT},
            headers={"Via": trail},
        ) as response,
    ):
        body = await response.json()
    assert response.status == 508
    assert body["error"]["code"] == "loop_detected"
    assert f"passed through {MAX_GATEWAY_HOPS} shoal gateways" in body["error"]["message"]


async def test_targets_sharing_a_base_url_and_secret_fail_over_to_each_other(
    store: Store, start_frontend: StartFrontend, monkeypatch: Any
) -> None:
    remote = await provider("gpt-4o")
    remote.failing_models = {"gpt-4o"}
    monkeypatch.setenv("SHOAL_SECRET_SHARED_KEY", "sk-shared")
    try:
        frontend = await start_frontend(inhibit_seconds=30)
        await serve_route(
            store,
            frontend,
            "split",
            url_target(remote.url, "gpt-4o", secret="shared-key"),
            url_target(remote.url, "gpt-4o-mini", secret="shared-key"),
        )
        client = openai_client(frontend)
        failures = 0
        for _ in range(20):
            try:
                reply = await client.chat.completions.create(model="split", messages=CHAT)  # type: ignore[arg-type]
                assert reply.model == "gpt-4o-mini"
            except openai.APIStatusError:
                failures += 1
        assert failures == 0
        assert remote.served == ["gpt-4o-mini"] * 20
        choices = frontend.routes.models["split"].choices
        failed, healthy = (c.upstream for c in choices)  # type: ignore[union-attr]
        assert failed is not None and failed.inhibited
        assert healthy is not None and not healthy.inhibited
    finally:
        await remote.stop()


KEY = "sk-PROVIDER-SECRET-0123456789abcdef"
ACCOUNT_HEADERS = {
    "Set-Cookie": "provider_session=abc; Path=/",
    "OpenAI-Organization": "org-of-the-operator",
    "OpenAI-Project": "proj-of-the-operator",
    "X-RateLimit-Remaining-Tokens": "12345",
}


async def echoing_provider(status: int) -> tuple[web.AppRunner, str]:
    """A provider that answers `status` quoting the bearer it was given (as OpenAI's
    "Incorrect API key provided: sk-..." does), with the operator's account headers."""

    async def answer(request: web.Request) -> web.Response:
        given = request.headers.get("Authorization", "")[len("Bearer ") :]
        error = {"message": f"Incorrect API key provided: {given}.", "code": "invalid_api_key"}
        return web.json_response({"error": error}, status=status, headers=ACCOUNT_HEADERS)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def post(frontend: Frontend, model: str) -> tuple[int, str, aiohttp.typedefs.LooseHeaders]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{frontend.url}/v1/chat/completions", json={"model": model, "messages": CHAT}
        ) as response,
    ):
        return response.status, await response.text(), response.headers


async def test_a_provider_refusing_the_gateways_key_is_a_502_that_never_shows_the_key(
    store: Store, start_frontend: StartFrontend, monkeypatch: Any
) -> None:
    """A provider's 401 quoting the operator's key ("Incorrect API key provided: sk-...") went
    to the client verbatim: the key, the provider's cookie, and a 401 that has the client's SDK
    blame its own gateway key. Now a provider's 401/403 is a failed attempt (another target
    serves), and with none left a 502 `provider_auth_failed` naming the provider and the
    virtual model; the provider's body is not relayed."""
    monkeypatch.setenv("SHOAL_SECRET_PKEY", KEY)
    refusing, refusing_url = await echoing_provider(401)
    good = await provider("remote-model")
    try:
        frontend = await start_frontend()
        refused = url_target(refusing_url, "m", secret="pkey", provider="default/acme")
        await serve_route(store, frontend, "alone", refused)
        status, text, headers = await post(frontend, "alone")
        assert status == 502, text
        error = json.loads(text)["error"]
        assert (error["type"], error["code"]) == ("server_error", "provider_auth_failed")
        assert "`default/acme`" in error["message"] and "`alone`" in error["message"]
        assert KEY not in text and "Incorrect API key" not in text
        assert "set-cookie" not in headers
        try:
            await openai_client(frontend).chat.completions.create(model="alone", messages=CHAT)  # type: ignore[arg-type]
            raise AssertionError("a refused provider answered")
        except openai.AuthenticationError as exc:
            raise AssertionError("the client was told its own key is bad") from exc
        except openai.InternalServerError as exc:
            assert exc.status_code == 502
        await serve_route(
            store, frontend, "pair", refused, url_target(good.url, "remote-model", weight=1)
        )
        for _ in range(5):  # the refusing target is inhibited after its first refusal
            status, text, _ = await post(frontend, "pair")
            assert status == 200 and KEY not in text, text
    finally:
        await refusing.cleanup()
        await good.stop()


async def test_a_providers_error_body_is_relayed_with_the_key_masked_and_no_account_headers(
    store: Store, start_frontend: StartFrontend, monkeypatch: Any
) -> None:
    """Any other error of a provider is relayed (the client's request may be at fault), with
    the operator's key masked and without the provider's `Set-Cookie`, `OpenAI-Organization`,
    `OpenAI-Project` and `x-ratelimit-*` (the operator's account, not the client's)."""
    monkeypatch.setenv("SHOAL_SECRET_PKEY", KEY)
    runner, url = await echoing_provider(400)
    try:
        frontend = await start_frontend()
        await serve_route(store, frontend, "v", url_target(url, "m", secret="pkey"))
        status, text, headers = await post(frontend, "v")
        assert status == 400
        message = json.loads(text)["error"]["message"]
        assert message == f"Incorrect API key provided: {'*' * len(KEY)}."
        for name in ACCOUNT_HEADERS:
            assert name not in headers, name
    finally:
        await runner.cleanup()


def test_a_key_is_masked_wherever_the_packets_cut_it() -> None:
    """The key may straddle two packets of the body: every cut of it is masked, and the body
    keeps its length (a `Content-Length` still holds)."""
    from shoal.frontend.proxy.routed import Masked

    secret = b"sk-0123456789"
    body = b'{"error":"key sk-0123456789 and sk-0123456789sk-0123456789 end"}'
    for first in range(len(body) + 1):
        for second in range(first, len(body) + 1):
            masked = Masked(secret)
            pieces = (body[:first], body[first:second], body[second:])
            out = b"".join(masked.feed(p) for p in pieces) + masked.rest()
            assert out == body.replace(secret, b"*" * len(secret)), (first, second)


async def test_a_provider_denying_one_model_still_serves_the_others_on_its_key(
    store: Store, start_frontend: StartFrontend, monkeypatch: Any
) -> None:
    """A 403 is the provider denying the key one model ("access to model X denied"): only
    that model's target is taken out, the provider's other models on the key serve on."""
    remote = await provider("gpt-4o")
    monkeypatch.setenv("SHOAL_SECRET_SHARED_KEY", "sk-shared")
    try:
        frontend = await start_frontend(inhibit_seconds=30)
        denied = url_target(remote.url, "o1-pro", secret="shared-key", provider="default/acme")
        allowed = url_target(remote.url, "gpt-4o", secret="shared-key", provider="default/acme")
        await serve_route(store, frontend, "premium", denied)
        await serve_route(store, frontend, "standard", allowed)
        remote.refusing = {"o1-pro": 403}
        status, text, _ = await post(frontend, "premium")
        assert status == 502 and "HTTP 403" in text, text
        assert upstream_of(frontend, "premium").inhibited
        assert not upstream_of(frontend, "standard").inhibited
        for _ in range(3):
            assert (await post(frontend, "standard"))[0] == 200
        assert remote.served == ["gpt-4o"] * 3
    finally:
        await remote.stop()


async def test_a_provider_refusing_the_key_takes_every_model_on_that_key_out_at_once(
    store: Store, start_frontend: StartFrontend, monkeypatch: Any
) -> None:
    """A 401 refuses the key itself: it took out only the target that got it, so each other
    model on the key cost a request a refusal (and a round trip) before its turn. Now every
    target on the key (the provider's base URL and the secret) is taken out at once; targets
    on another key of the same provider are not."""
    remote = await provider("gpt-4o")
    other = await provider("gpt-4o")
    monkeypatch.setenv("SHOAL_SECRET_SHARED_KEY", "sk-shared")
    monkeypatch.setenv("SHOAL_SECRET_OTHER_KEY", "sk-other")
    try:
        frontend = await start_frontend(inhibit_seconds=30)
        on_key = {"secret": "shared-key", "provider": "default/acme"}
        await serve_route(store, frontend, "premium", url_target(remote.url, "o1-pro", **on_key))
        await serve_route(
            store,
            frontend,
            "standard",
            url_target(remote.url, "gpt-4o", weight=1000, **on_key),
            url_target(other.url, "gpt-4o", weight=1),
        )
        await serve_route(
            store, frontend, "team", url_target(remote.url, "gpt-4o", secret="other-key")
        )
        remote.refusing = {"o1-pro": 401, "gpt-4o": 401}
        status, text, _ = await post(frontend, "premium")
        assert status == 502 and "HTTP 401" in text, text
        assert upstream_of(frontend, "standard").inhibited
        assert not upstream_of(frontend, "team").inhibited  # (another key)
        for _ in range(3):
            assert (await post(frontend, "standard"))[0] == 200
        assert [json.loads(b)["model"] for b in remote.bodies] == ["o1-pro"]
        assert other.served == ["gpt-4o"] * 3
    finally:
        await remote.stop()
        await other.stop()


def upstream_of(frontend: Frontend, name: str) -> Any:
    """The upstream of the first target of virtual model `name` (a `url` target)."""
    upstream = frontend.routes.models[name].choices[0].upstream  # type: ignore[union-attr]
    assert upstream is not None
    return upstream
