"""End to end: real `shoal worker` processes and a `shoal frontend --namespace-sources`
process, on SQLite and on a real etcd; the sources file is rewritten while the official
`openai` client sends requests."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from pathlib import Path

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.etcd_server import EtcdServer
from tests.helpers import wait_for
from tests.membership.test_frontend import write_sources
from tests.processes import Processes

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello."}]
FAST = ("--lease-ttl", "2", "--ttft-ms", "5", "--itl-ms", "2")


@pytest.fixture(params=["sqlite", pytest.param("etcd", marks=pytest.mark.etcd)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    server: EtcdServer = request.getfixturevalue("etcd_server")
    return server.url


async def answers(client: openai.AsyncOpenAI, model: str) -> int:
    """The HTTP status a chat request to `model` gets."""
    try:
        await client.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


async def test_rewriting_the_sources_file_moves_the_scope_while_clients_send_requests(
    processes: Processes, store_url: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]  # tests sharing one etcd never see each other's workers
    keep, old, new = f"keep-{tag}", f"old-{tag}", f"new-{tag}"
    await asyncio.gather(
        processes.worker(store_url, "--namespace", keep, *FAST, model="stay-llm"),
        processes.worker(store_url, "--namespace", old, *FAST, model="gone-llm"),
        processes.worker(store_url, "--namespace", new, *FAST, model="new-llm"),
    )
    path = tmp_path / "sources.json"
    write_sources(path, keep, old)
    front = await processes.start(
        "frontend", "--store", store_url, "--port", "0", "--namespace-sources", str(path),
        "--cache-dir", str(tmp_path / "cache"), ready="frontend",
    )  # fmt: skip
    client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0)

    async def listed() -> set[str]:
        return {m.id for m in (await client.models.list()).data}

    await wait_for(lambda: _equals(listed(), {"stay-llm", "gone-llm"}), timeout=15)
    statuses: list[int] = []
    stop = asyncio.Event()

    async def load() -> None:
        while not stop.is_set():
            statuses.append(await answers(client, "stay-llm"))

    sender = asyncio.create_task(load())
    revision = write_sources(path, keep, new)
    await wait_for(lambda: _equals(answers(client, "gone-llm"), 404), timeout=10)
    await wait_for(lambda: _equals(answers(client, "new-llm"), 200), timeout=15)
    stop.set()
    await sender
    assert statuses and set(statuses) == {200}, statuses
    assert await listed() == {"stay-llm", "new-llm"}
    async with aiohttp.ClientSession() as session:
        status = await (await session.get(f"{front.url}/v1/membership/status")).json()
        view = await (await session.get(f"{front.url}/v1/membership")).json()
    assert status == {
        "desired_revision": revision,
        "applied_revision": revision,
        "count": 2,
        "last_error": None,
    }
    assert view["namespaces"] == sorted([keep, new])
    assert {ep["models"][0]["name"] for ep in view["endpoints"]} == {"stay-llm", "new-llm"}


async def _equals(value: Awaitable[object], expected: object) -> bool:
    return await value == expected
