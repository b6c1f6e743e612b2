"""Virtual models end to end: real `shoal worker` (mocker) and `shoal frontend` processes, the
official openai client, routes written into SQLite and a real etcd as the models controller
writes them; a `url` target that is a second shoal frontend serving HTTPS with a certificate
made by the test and requiring an API key."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from shoal.discovery import FleetTarget, Route, UrlTarget, publish_route
from shoal.store import open_store
from tests.etcd_server import EtcdServer
from tests.helpers import wait_for
from tests.processes import Process, Processes

FAST = ("--lease-ttl", "2", "--ttft-ms", "5", "--itl-ms", "2")
CHAT: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Hi."}]


@pytest.fixture(params=["sqlite", "etcd"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
    else:
        server: EtcdServer = request.getfixturevalue("etcd_server")
        yield server.url


def client_for(url: str, **kwargs: object) -> openai.AsyncOpenAI:
    kwargs.setdefault("api_key", "unused")
    return openai.AsyncOpenAI(base_url=f"{url}/v1", max_retries=0, **kwargs)  # type: ignore[arg-type]


async def listed(url: str, name: str, **headers: str) -> bool:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url}/v1/models", headers=headers) as response,
    ):
        if response.status != 200:
            return False
        return name in {m["id"] for m in (await response.json())["data"]}


async def frontend(processes: Processes, store_url: str, tmp_path: Path, *args: str) -> Process:
    name = f"cache-{uuid.uuid4().hex[:6]}"
    return await processes.start(
        "frontend", "--store", store_url, "--port", "0", "--cache-dir", str(tmp_path / name),
        "--reconcile-interval", "1", *args, ready="frontend",
    )  # fmt: skip


async def test_an_alias_reaches_mocker_workers_under_the_name_they_serve(
    processes: Processes, store_url: str, tmp_path: Path
) -> None:
    workspace = f"ws-{uuid.uuid4().hex[:8]}"  # tests sharing one etcd do not see each other
    namespace = f"ns-{uuid.uuid4().hex[:8]}"
    await asyncio.gather(
        *(processes.worker(store_url, "--namespace", namespace, *FAST) for _ in range(2))
    )
    front = await frontend(
        processes, store_url, tmp_path, "--namespace", namespace, "--workspace", workspace
    )
    store = await open_store(store_url)
    try:
        await publish_route(
            store, Route(workspace=workspace, name="gpt-fast", targets=(FleetTarget("mock-llm"),))
        )
    finally:
        await store.close()
    await wait_for(lambda: listed(front.url, "gpt-fast"), timeout=15)
    client = client_for(front.url)
    assert sorted(m.id for m in (await client.models.list()).data) == ["gpt-fast", "mock-llm"]
    # The mocker refuses a name it does not serve: an answer means the body was rewritten.
    reply = await client.chat.completions.create(model="gpt-fast", messages=CHAT, max_tokens=4)
    assert reply.model == "mock-llm"
    assert reply.choices[0].message.content
    stream = await client.chat.completions.create(
        model="gpt-fast", messages=CHAT, max_tokens=4, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert {c.model for c in chunks} == {"mock-llm"}
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 4


async def test_a_url_target_is_another_frontend_over_https_with_its_api_key(
    processes: Processes,
    tmp_path: Path,
    certificates: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The provider: its own store, a mocker worker, a frontend serving HTTPS with a key.
    remote_store = f"sqlite:///{tmp_path / 'remote.db'}"
    await processes.worker(remote_store, *FAST)
    remote = await frontend(
        processes, remote_store, tmp_path,
        "--tls-certfile", str(certificates["cert"]), "--tls-keyfile", str(certificates["key"]),
        "--api-key", "sk-remote",
    )  # fmt: skip
    assert remote.url.startswith("https://")
    port = remote.url.rsplit(":", 1)[1]
    await wait_for(
        lambda: listed_tls(remote.url, certificates["ca"], "mock-llm", "sk-remote"), timeout=15
    )

    # The gateway: a route to the provider by URL; the key comes from SHOAL_SECRET_REMOTE_KEY.
    local_store = f"sqlite:///{tmp_path / 'local.db'}"
    monkeypatch.setenv("SHOAL_SECRET_REMOTE_KEY", "sk-remote")  # (the child's environment)
    local = await frontend(
        processes, local_store, tmp_path, "--provider-ca-file", str(certificates["ca"])
    )
    store = await open_store(local_store)
    try:
        target = UrlTarget(
            base_url=f"https://localhost:{port}/v1", model="mock-llm", secret="remote-key"
        )
        keyless = UrlTarget(base_url=f"https://localhost:{port}/v1", model="mock-llm")
        await publish_route(store, Route(workspace="default", name="remote", targets=(target,)))
        await publish_route(store, Route(workspace="default", name="no-key", targets=(keyless,)))
    finally:
        await store.close()
    await wait_for(lambda: listed(local.url, "remote"), timeout=15)

    client = client_for(local.url, api_key="the-clients-own-key")
    reply = await client.chat.completions.create(model="remote", messages=CHAT, max_tokens=4)
    assert reply.model == "mock-llm"
    stream = await client.chat.completions.create(
        model="remote", messages=CHAT, max_tokens=4, stream=True
    )
    assert len([c async for c in stream if c.choices and c.choices[0].delta.content]) == 4
    # Without the secret the provider refuses: the gateway's credentials, not the client's key
    # (a 502 `provider_auth_failed`, never the provider's 401).
    with pytest.raises(openai.InternalServerError) as refused:
        await client.chat.completions.create(model="no-key", messages=CHAT, max_tokens=4)
    assert refused.value.code == "provider_auth_failed"


async def listed_tls(url: str, ca: Path, name: str, key: str) -> bool:
    import ssl

    context = ssl.create_default_context(cafile=str(ca))
    connector = aiohttp.TCPConnector(ssl=context)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}) as response,
    ):
        if response.status != 200:
            return False
        return name in {m["id"] for m in (await response.json())["data"]}


async def test_an_https_provider_with_an_untrusted_certificate_is_not_reached(
    processes: Processes, tmp_path: Path, certificates: dict[str, Path]
) -> None:
    remote_store = f"sqlite:///{tmp_path / 'remote.db'}"
    remote = await frontend(
        processes, remote_store, tmp_path,
        "--tls-certfile", str(certificates["cert"]), "--tls-keyfile", str(certificates["key"]),
    )  # fmt: skip
    port = remote.url.rsplit(":", 1)[1]
    local_store = f"sqlite:///{tmp_path / 'local.db'}"
    local = await frontend(processes, local_store, tmp_path)  # the system's CAs only
    store = await open_store(local_store)
    try:
        target = UrlTarget(base_url=f"https://localhost:{port}/v1", model="mock-llm")
        await publish_route(store, Route(workspace="default", name="remote", targets=(target,)))
    finally:
        await store.close()
    await wait_for(lambda: listed(local.url, "remote"), timeout=15)
    with pytest.raises(openai.APIStatusError) as raised:
        await client_for(local.url).chat.completions.create(model="remote", messages=CHAT)
    assert raised.value.status_code == 502
    assert "CERTIFICATE_VERIFY_FAILED" in str(raised.value.message)


async def test_tls_flags_go_together(processes: Processes, tmp_path: Path) -> None:
    from tests.processes import shoal

    proc = await shoal(
        "frontend", "--tls-certfile", str(tmp_path / "cert.pem"),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert b"--tls-certfile and --tls-keyfile go together" in err
