"""What a frontend with API keys shows to callers without one, and how dashboard sessions work:
`/health` details need the key, the bearer scheme is case-insensitive, 405s say what is
allowed, and a dashboard session is a random id that expires and ends at log out."""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shoal.cli.frontend import config_from_args
from shoal.cli.main import build_parser
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.dashboard.dashboard import COOKIE, Sessions
from tests.etcd_server import EtcdServer
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import serving
from tests.helpers import wait_for

DETAILS = {"models", "virtual_models", "metadata_cache", "store", "skipped", "incomplete"}


async def get(url: str, **headers: str) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, await response.json(), response.headers


async def test_health_without_the_key_says_only_the_status_and_its_reasons(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker()
    frontend = await start_frontend(api_keys=("s3cret",))
    await wait_for(lambda: serving(frontend))
    status, body, _ = await get(f"{frontend.url}/health")
    assert status == 200
    assert set(body) <= {"status", "reasons"} and body["status"] == "ok"
    for scheme in ("Bearer", "bearer", "BEARER"):
        status, body, _ = await get(f"{frontend.url}/health", Authorization=f"{scheme} s3cret")
        assert status == 200 and set(body) >= DETAILS
        assert "mock-llm" in body["models"]
    _, body, _ = await get(f"{frontend.url}/health", Authorization="Bearer guess")
    assert set(body) <= {"status", "reasons"}


async def test_public_health_shows_the_details_without_the_key(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker()
    frontend = await start_frontend(api_keys=("s3cret",), public_health=True)
    await wait_for(lambda: serving(frontend))
    status, body, _ = await get(f"{frontend.url}/health")
    assert status == 200 and set(body) >= DETAILS


async def test_without_api_keys_health_shows_its_details(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend()
    _, body, _ = await get(f"{frontend.url}/health")
    assert set(body) >= DETAILS


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
async def test_the_bearer_scheme_is_case_insensitive(
    start_frontend: StartFrontend, scheme: str
) -> None:
    frontend = await start_frontend(api_keys=("s3cret",))
    status, _, _ = await get(f"{frontend.url}/v1/models", Authorization=f"{scheme} s3cret")
    assert status == 200
    status, _, _ = await get(f"{frontend.url}/ui/api/snapshot", Authorization=f"{scheme} s3cret")
    assert status == 200
    for refused in (f"{scheme} guess", "Basic s3cret", "s3cret", f"{scheme}s3cret"):
        status, _, _ = await get(f"{frontend.url}/v1/models", Authorization=refused)
        assert status == 401, refused


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/embeddings", "POST"),
        ("POST", "/health", "GET, HEAD"),
        ("DELETE", "/v1/models", "GET, HEAD"),
        ("POST", "/ui/", "GET, HEAD"),
        ("GET", "/ui/api/login", "POST"),
        ("POST", "/ui/api/snapshot", "GET, HEAD"),
        ("HEAD", "/ui/api/events", "GET"),
    ],
)
async def test_a_405_names_the_allowed_methods(
    start_frontend: StartFrontend, method: str, path: str, allowed: str
) -> None:
    frontend = await start_frontend()
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, f"{frontend.url}{path}") as response,
    ):
        assert response.status == 405
        assert response.headers["Allow"] == allowed


async def login(session: aiohttp.ClientSession, frontend: Frontend, key: str) -> str:
    """Log in; the `Set-Cookie` header."""
    response = await session.post(f"{frontend.url}/ui/api/login", json={"key": key})
    assert response.status == 200
    return response.headers["set-cookie"]


def session_of(set_cookie: str) -> str:
    return set_cookie.split(";")[0].split("=", 1)[1]


async def snapshot_status(frontend: Frontend, session_id: str | None) -> int:
    headers = {"Cookie": f"{COOKIE.decode()}={session_id}"} if session_id else {}
    status, _, _ = await get(f"{frontend.url}/ui/api/snapshot", **headers)
    return status


async def test_a_dashboard_session_is_random_and_ends_at_log_out(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(api_keys=("s3cret",))
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        first, second = (
            await login(session, frontend, "s3cret"),
            await login(session, frontend, "s3cret"),
        )
        for cookie in (first, second):
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
            assert "Max-Age=" in cookie and "Secure" not in cookie  # (plain HTTP)
        a, b = session_of(first), session_of(second)
        assert a != b and len(a) >= 40  # a fresh random id per login
        assert await snapshot_status(frontend, a) == 200
        assert await snapshot_status(frontend, b) == 200
        logout = await session.post(
            f"{frontend.url}/ui/api/logout", headers={"Cookie": f"shoal_ui={a}"}
        )
        assert logout.status == 200 and "Max-Age=0" in logout.headers["set-cookie"]
    assert await snapshot_status(frontend, a) == 401  # revoked on this frontend, not just forgotten
    assert await snapshot_status(frontend, b) == 200  # another login is another session
    assert await snapshot_status(frontend, "made-up") == 401


async def test_a_login_with_a_deeply_nested_body_is_400(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend(api_keys=("s3cret",))
    body = b'{"key":"s3cret","x":' + b"[" * 1_000 + b"]" * 1_000 + b"}"
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{frontend.url}/ui/api/login", data=body)
        assert response.status == 400
        assert "nested deeper than 64 levels" in (await response.json())["error"]["message"]


def test_sessions_expire_and_the_store_keeps_at_most_its_limit() -> None:
    now = [1000.0]
    sessions = Sessions(ttl=60, limit=3, clock=lambda: now[0])
    first = sessions.open().encode()
    assert sessions.valid(first)
    now[0] += 59
    assert sessions.valid(first)
    now[0] += 1
    assert not sessions.valid(first) and len(sessions) == 0  # expired and forgotten
    ids = [sessions.open().encode() for _ in range(5)]
    assert len(sessions) == 3  # the two oldest made room
    assert [sessions.valid(s) for s in ids] == [False, False, True, True, True]
    sessions.close(ids[-1])
    assert not sessions.valid(ids[-1])


async def test_the_session_cookie_is_secure_on_an_https_listener(
    start_frontend: StartFrontend, certificates: dict[str, Path]
) -> None:
    frontend = await start_frontend(
        api_keys=("s3cret",), tls_certfile=certificates["cert"], tls_keyfile=certificates["key"]
    )
    assert frontend.url.startswith("https://")
    context = ssl.create_default_context(cafile=str(certificates["ca"]))
    connector = aiohttp.TCPConnector(ssl=context)
    async with aiohttp.ClientSession(connector=connector) as session:
        cookie = await login(session, frontend, "s3cret")
    assert "Secure" in cookie.split("; ")


async def test_a_tls_client_that_never_finishes_its_handshake_is_closed_by_the_head_timeout(
    start_frontend: StartFrontend, certificates: dict[str, Path]
) -> None:
    """A connection counts against `max_connections` and the head timeout once its TLS
    handshake is done: before, asyncio's own 60 s handshake timeout alone bounded it, so
    connections that sent nothing (or half a handshake) held a socket each for a minute
    whatever `--header-timeout` said. The handshake now has the head's timeout."""
    frontend = await start_frontend(
        tls_certfile=certificates["cert"], tls_keyfile=certificates["key"], header_timeout=0.5
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(b"\x16\x03\x01")  # (the start of a ClientHello, never finished)
        began = asyncio.get_running_loop().time()
        async with asyncio.timeout(20):
            assert await reader.read() == b""  # closed by the server
        assert asyncio.get_running_loop().time() - began < 5
    finally:
        writer.close()


async def test_metrics_port_serves_metrics_alone_and_the_api_port_no_longer_does(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(api_keys=("s3cret",), metrics_port=0)
    assert frontend.metrics_server is not None
    scrape = f"http://127.0.0.1:{frontend.metrics_server.port}"
    async with aiohttp.ClientSession() as session:
        metrics = await session.get(f"{scrape}/metrics")
        assert metrics.status == 200
        assert "shoal_frontend_" in await metrics.text()
        assert (await session.get(f"{scrape}/v1/models")).status == 404
        wrong = await session.post(f"{scrape}/metrics")
        assert (wrong.status, wrong.headers["Allow"]) == (405, "GET, HEAD")
        assert (await session.get(f"{frontend.url}/metrics")).status == 404


async def test_a_scrape_written_in_pieces_has_its_length_and_a_head_request_none_of_it(
    start_frontend: StartFrontend,
) -> None:
    """`/metrics` goes out in the pieces it was written in (`send_pieces`): its
    Content-Length is the body's, the text parses, and HEAD gets the same head, no body."""
    from prometheus_client.parser import text_string_to_metric_families

    frontend = await start_frontend(metrics_port=0)
    assert frontend.metrics_server is not None
    scrape = f"http://127.0.0.1:{frontend.metrics_server.port}/metrics"
    async with aiohttp.ClientSession() as session:
        got = await session.get(scrape)
        body = await got.read()
        assert int(got.headers["Content-Length"]) == len(body) > 0
        names = {f.name for f in text_string_to_metric_families(body.decode())}
        assert "shoal_frontend_live_instances" in names
        head = await session.head(scrape)
        assert head.status == 200
        assert int(head.headers["Content-Length"]) > 0
        assert await head.read() == b""
        again = await session.get(scrape)  # (the connection is still in step)
        assert again.status == 200 and len(await again.read()) > 0


def test_the_metrics_port_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(["frontend", "--metrics-port", "9101", "--public-health"])
    config = config_from_args(args)
    assert (config.metrics_port, config.public_health) == (9101, True)
    assert config_from_args(build_parser().parse_args(["frontend"])).metrics_port is None


async def test_health_controllers_without_the_key_names_the_loops_but_not_the_errors(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    """A store outage's reasons quote the store's errors (its address, a user name): without
    the key `/health/controllers` names the loops in trouble only; the key shows why."""
    config = FrontendConfig(
        store_url=own_etcd.url,
        port=0,
        cache_dir=tmp_path / "c",
        reconcile_interval=0.2,
        api_keys=("s3cret",),
    )
    frontend = Frontend(config)
    try:
        await frontend.start()
        own_etcd.stop()
        url = f"{frontend.url}/health/controllers"

        async def both_reported() -> dict[str, str] | None:
            _, body, _ = await get(url, Authorization="Bearer s3cret")
            unhealthy: dict[str, str] = body["unhealthy"]
            return unhealthy if {"store", "model-reconciler"} <= set(unhealthy) else None

        with_key = await wait_for(both_reported, timeout=30)
        assert own_etcd.url.split("://")[-1] in with_key["store"]
        status, body, _ = await get(url)
        assert status == 503 and body["status"] == "unavailable"
        assert set(body["unhealthy"]) >= {"store", "model-reconciler"}
        assert own_etcd.url.split("://")[-1] not in json.dumps(body)
        assert set(body["unhealthy"].values()) == {"unhealthy"}
    finally:
        await frontend.stop()
