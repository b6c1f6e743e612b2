"""End to end: real `shoal worker` and `shoal frontend` processes, the official openai client,
on the SQLite store and on a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from shoal.discovery import Discovery, Query
from shoal.frontend import Frontend, FrontendConfig
from shoal.store import open_store
from tests.etcd_server import EtcdServer
from tests.helpers import free_port, wait_for
from tests.processes import Process, Processes

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
# Workers of these tests: fast, and their lease ends 2 s after they die.
FAST = ("--lease-ttl", "2", "--ttft-ms", "5", "--itl-ms", "2")


@pytest.fixture(params=["sqlite", "etcd"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
    else:
        server: EtcdServer = request.getfixturevalue("etcd_server")
        yield server.url


@pytest.fixture
def namespace() -> str:
    """Each test's own namespace: tests sharing one etcd never see each other's workers."""
    return f"e2e-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def frontend(store_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[Frontend]:
    """An in-process frontend (its registry is inspected by the tests)."""
    config = FrontendConfig(
        store_url=store_url,
        port=0,
        namespaces=(namespace,),
        reconcile_interval=1.0,
        cache_dir=tmp_path / "cache",
        inhibit_seconds=2.0,
        drain_timeout=5.0,
    )
    front = Frontend(config)
    await front.start()
    yield front
    await front.stop()


def serving(frontend: Frontend, instances: int, model: str = "mock-llm") -> bool:
    entry = frontend.registry.models.get(model)
    return entry is not None and entry.live_instances == instances


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_openai_client_through_a_frontend_process_to_worker_processes(
    processes: Processes, store_url: str, namespace: str, tmp_path: Path
) -> None:
    workers = await asyncio.gather(
        *(processes.worker(store_url, "--namespace", namespace, *FAST) for _ in range(2))
    )
    front = await processes.start(
        "frontend", "--store", store_url, "--port", "0", "--namespace", namespace,
        "--cache-dir", str(tmp_path / "cache"), ready="frontend",
    )  # fmt: skip
    client = client_for(front.url)

    async def both_listed() -> bool:
        async with aiohttp.ClientSession() as session:
            health = await (await session.get(f"{front.url}/health")).json()
        return bool(health.get("models", {}).get("mock-llm", {}).get("instances") == 2)

    await wait_for(both_listed, timeout=10)
    assert [m.id for m in (await client.models.list()).data] == ["mock-llm"]
    reply = await client.chat.completions.create(model="mock-llm", messages=CHAT, max_tokens=8)
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    stream = await client.chat.completions.create(
        model="mock-llm",
        messages=CHAT,
        max_tokens=8,
        stream=True,
    )
    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
    assert len([p for p in pieces if p]) == 8
    completion = await client.completions.create(model="mock-llm", prompt="Once", max_tokens=4)
    assert completion.choices[0].text
    served_by = set()
    async with aiohttp.ClientSession() as session:
        for _ in range(4):
            response = await session.post(
                f"{front.url}/v1/chat/completions",
                json={"model": "mock-llm", "messages": CHAT, "max_tokens": 2},
            )
            assert response.status == 200
            served_by.add(int(response.headers["x-shoal-instance"], 16))
    assert served_by == {w.instance_id for w in workers}
    front.signal(signal.SIGTERM)
    assert await front.wait() == 0


class Load:
    """Clients sending chat completions in a loop, streaming and not, recording every outcome."""

    def __init__(self, url: str, clients: int = 8) -> None:
        self.client = client_for(url)
        self.clients = clients
        self.stop = asyncio.Event()
        self.ok = 0
        self.failed_before_first_byte: list[str] = []
        self.failed_mid_stream: list[str] = []

    async def _loop(self, n: int) -> None:
        while not self.stop.is_set():
            if n % 2:
                await self._stream()
            else:
                try:
                    await self.client.chat.completions.create(
                        model="mock-llm",
                        messages=CHAT,
                        max_tokens=20,
                    )
                    self.ok += 1
                except openai.APIError as exc:
                    self.failed_before_first_byte.append(repr(exc))

    async def _stream(self) -> None:
        received = 0
        try:
            stream = await self.client.chat.completions.create(
                model="mock-llm",
                messages=CHAT,
                max_tokens=20,
                stream=True,
            )
            async for _ in stream:
                received += 1
            self.ok += 1
        except openai.APIError as exc:
            (self.failed_mid_stream if received else self.failed_before_first_byte).append(
                repr(exc)
            )

    async def run_until(self, condition: asyncio.Event) -> None:
        tasks = [asyncio.create_task(self._loop(n)) for n in range(self.clients)]
        await condition.wait()
        self.stop.set()
        await asyncio.gather(*tasks)


@contextlib.asynccontextmanager
async def under_load(
    processes: Processes, frontend: Frontend, store_url: str, namespace: str, workers: int
) -> AsyncIterator[tuple[list[Process], Load]]:
    """`workers` fast workers served by `frontend`, under a `Load` that has already succeeded
    30 times; the load stops when the block ends."""
    started = await asyncio.gather(
        *(processes.worker(store_url, "--namespace", namespace, *FAST) for _ in range(workers))
    )
    await wait_for(lambda: serving(frontend, workers), timeout=10)
    load = Load(frontend.url)
    done = asyncio.Event()
    running = asyncio.create_task(load.run_until(done))
    try:
        await wait_for(lambda: load.ok >= 30, timeout=10)
        yield list(started), load
    finally:
        done.set()
        await running


async def test_worker_killed_under_load_fails_no_request_that_had_not_started_streaming(
    processes: Processes, frontend: Frontend, store_url: str, namespace: str
) -> None:
    async with under_load(processes, frontend, store_url, namespace, 3) as (workers, load):
        victim = workers[0]
        victim.signal(signal.SIGKILL)
        before = load.ok
        await wait_for(lambda: load.ok >= before + 60, timeout=15)
        # Its lease (TTL 2 s) ends, and with it the registration.
        await wait_for(lambda: victim.instance_id not in _instances(frontend), timeout=2 + 3)
    assert load.failed_before_first_byte == []
    # The failure path was taken: a request sent to the dead worker was retried, or its
    # streams in flight were migrated and it was taken out of routing before any was sent
    # (which of the two depends on where the kill lands: a retry alone is a race).
    inhibited = frontend.metrics.instances_inhibited._value.get()
    assert frontend.metrics.models["mock-llm"].retries + inhibited >= 1
    assert serving(frontend, 2)


async def test_worker_drained_with_sigterm_under_load_fails_no_request(
    processes: Processes, frontend: Frontend, store_url: str, namespace: str
) -> None:
    async with under_load(processes, frontend, store_url, namespace, 2) as (workers, load):
        leaving = workers[0]
        leaving.signal(signal.SIGTERM)
        assert await leaving.wait(20) == 0
        await wait_for(lambda: leaving.instance_id not in _instances(frontend), timeout=5)
        before = load.ok
        await wait_for(lambda: load.ok >= before + 30, timeout=10)
    assert load.failed_before_first_byte == []
    assert load.failed_mid_stream == []


async def test_client_disconnect_frees_the_mocker_sequence(
    processes: Processes, frontend: Frontend, store_url: str, namespace: str
) -> None:
    worker = await processes.worker(
        store_url, "--namespace", namespace, "--lease-ttl", "2", "--ttft-ms", "5", "--itl-ms", "50"
    )
    await wait_for(lambda: serving(frontend, 1), timeout=10)
    status_url = worker.status_url

    async def active_sequences(session: aiohttp.ClientSession) -> float:
        text = await (await session.get(f"{status_url}/metrics")).text()
        for line in text.splitlines():
            if line.startswith("shoal_mocker_active_sequences{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no shoal_mocker_active_sequences in the worker's /metrics")

    body = {"model": "mock-llm", "messages": CHAT, "max_tokens": 500, "stream": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{frontend.url}/v1/chat/completions", json=body)
        await response.content.readline()
        assert await active_sequences(session) == 1
        response.close()  # the client goes away mid-stream

        async def freed() -> bool:
            return await active_sequences(session) == 0

        await wait_for(freed, timeout=5, message="the mocker freed the sequence")


async def test_a_worker_joining_later_is_listed_and_served(
    processes: Processes, frontend: Frontend, store_url: str, namespace: str
) -> None:
    await processes.worker(store_url, "--namespace", namespace, *FAST)
    await wait_for(lambda: serving(frontend, 1), timeout=10)
    late = await processes.worker(store_url, "--namespace", namespace, *FAST, model="late-llm")
    await wait_for(lambda: serving(frontend, 1, "late-llm"), timeout=5)
    client = client_for(frontend.url)
    assert sorted(m.id for m in (await client.models.list()).data) == ["late-llm", "mock-llm"]
    reply = await client.chat.completions.create(model="late-llm", messages=CHAT, max_tokens=3)
    assert reply.model == "late-llm"
    late.signal(signal.SIGTERM)
    await late.wait(20)
    await wait_for(lambda: "late-llm" not in frontend.registry.models, timeout=5)


async def test_error_cases_in_openai_format(
    processes: Processes, store_url: str, namespace: str, tmp_path: Path
) -> None:
    worker = await processes.worker(store_url, "--namespace", namespace, *FAST)
    config = FrontendConfig(
        store_url=store_url, port=0, namespaces=(namespace,), api_keys=("sk-test",),
        max_body=4096, cache_dir=tmp_path / "cache", drain_timeout=2,
    )  # fmt: skip
    async with Frontend(config) as front:
        await wait_for(lambda: serving(front, 1), timeout=10)
        url = f"{front.url}/v1/chat/completions"
        auth = {"Authorization": "Bearer sk-test"}
        ok = {"model": "mock-llm", "messages": CHAT, "max_tokens": 2}
        async with aiohttp.ClientSession() as session:

            async def error(status: int, **kwargs: Any) -> dict[str, Any]:
                response = await session.post(url, **kwargs)
                assert response.status == status, await response.text()
                body = await response.json()
                assert set(body["error"]) == {"message", "type", "param", "code"}
                return dict(body["error"])

            assert (await error(401, json=ok))["code"] == "invalid_api_key"
            assert await error(401, json=ok, headers={"Authorization": "Bearer no"})
            assert (await error(404, json={**ok, "model": "nope"}, headers=auth))[
                "param"
            ] == "model"
            assert (await error(400, data=b"{not json", headers=auth))[
                "type"
            ] == "invalid_request_error"
            assert (await error(400, json={"messages": CHAT}, headers=auth))["param"] == "model"
            await error(413, json={**ok, "pad": "x" * 5000}, headers=auth)
            assert (await session.post(url, json=ok, headers=auth)).status == 200
            # A known model whose only instance is tainted: 503.
            store = await open_store(store_url)
            try:
                discovery = Discovery(store)
                (key,) = [m.key for m in await discovery.list(Query(namespace))]
                await discovery.update_taints(key, ["maintenance"])
                await wait_for(lambda: serving(front, 0), timeout=5)
                assert (await error(503, json=ok, headers=auth))["code"] == "no_ready_instance"
                await discovery.update_taints(key, [])
                await wait_for(lambda: serving(front, 1), timeout=5)
            finally:
                await store.close()
            assert (await session.post(url, json=ok, headers=auth)).status == 200
    assert worker.proc.returncode is None


def _instances(frontend: Frontend) -> set[int]:
    return {
        member.key.instance_id
        for model in frontend.registry.models.values()
        for ws in model.sets.values()
        for member in ws.members.values()
    }


async def test_shoal_up_starts_a_fleet_that_another_worker_joins_and_stops_cleanly(
    processes: Processes, tmp_path: Path
) -> None:
    store_url = f"sqlite:///{tmp_path / 'up.db'}"
    port = free_port()
    up = await processes.start(
        "up", "--workers", "2", "--port", str(port), "--store", store_url,
        ready=_PRESS_CTRL_C, timeout=60,
    )  # fmt: skip
    output = "".join(up.stdout)
    url = f"http://127.0.0.1:{port}"
    assert f"curl {url}/v1/chat/completions" in output
    assert f'OpenAI(base_url="{url}/v1"' in output
    client = client_for(url)
    reply = await client.chat.completions.create(model="mock-llm", messages=CHAT, max_tokens=3)
    assert reply.choices[0].message.content
    joining = await processes.worker(store_url, *FAST)

    async def three_instances() -> bool:
        async with aiohttp.ClientSession() as session:
            health = await (await session.get(f"{url}/health")).json()
        return bool(health["models"]["mock-llm"]["instances"] == 3)

    await wait_for(three_instances, timeout=10, message="the joining worker is served")
    up.signal(signal.SIGINT)
    assert await up.wait(45) == 0
    assert "shoal up: stopped" in (await _rest(up))
    store = await open_store(store_url)
    try:
        left = await Discovery(store).list(Query())
        assert [m.instance_id for m in left] == [joining.instance_id]  # up's workers drained
    finally:
        await store.close()


_PRESS_CTRL_C = re.compile(r"^Press Ctrl-C to stop\.$")


async def _rest(process: Process) -> str:
    assert process.proc.stdout is not None
    return "".join(process.stdout) + (await process.proc.stdout.read()).decode()
