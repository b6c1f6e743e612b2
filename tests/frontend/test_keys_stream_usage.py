"""A key's stream is charged the engine's usage, though its client asked for none: real mocker
processes, an in-process frontend with `--auth keys`, the official `openai` client (and fake
workers and a fake provider for what each is sent).

What was wrong: a key's stream without `stream_options.include_usage` was charged one
completion token per event and its prompt as body bytes / 4 (an engine sending 3 tokens an
event: 12 tokens charged for 30). The gateway now asks the engine for the usage event, charges
it, and keeps it from the client, who sees the stream it would have seen."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from shoal.discovery import FleetTarget, Route, publish_route
from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.proxy.fields import LARGE_BODY
from shoal.store import Store, open_store
from shoal.worker.engines.mocker import MockerEngine
from tests.frontend.conftest import StartFrontend, StartWorker, openai_client
from tests.frontend.test_providers import CHAT, provider, serve_route, url_target
from tests.helpers import wait_for
from tests.processes import Process, Processes

MODEL = "mock-llm"
SECRET = "sk-shoal-" + "u" * 43
OPERATOR = "sk-operator-" + "o" * 20  # an `--api-key`: the path of a request without a key
FAST = ("--lease-ttl", "2", "--ttft-ms", "5", "--itl-ms", "10")
Record = tuple[Any, ...]


class Fleet:
    """Mocker processes on one SQLite store, and an in-process frontend with `--auth keys`
    whose usage records are kept (`records`: grant, model, served, status, prompt,
    completion)."""

    def __init__(self, processes: Processes, tmp: Path) -> None:
        self.processes = processes
        self.tmp = tmp
        self.store_url = f"sqlite:///{tmp / 'store.db'}"
        self.workers: list[Process] = []
        self.records: list[Record] = []
        self.front: Frontend | None = None

    async def worker(self, *args: str) -> Process:
        worker = await self.processes.worker(self.store_url, *FAST, *args, model=MODEL)
        self.workers.append(worker)
        return worker

    async def frontend(self, **settings: Any) -> Frontend:
        store = await open_store(self.store_url)
        await store.put(*_grant())
        await store.close()
        config = FrontendConfig(
            store_url=self.store_url, port=0, auth="keys", api_keys=(OPERATOR,),
            cache_dir=self.tmp / "cache", drain_timeout=2.0, **settings,
        )  # fmt: skip
        front = self.front = Frontend(config)
        await front.start()
        front.gate.record = lambda *record: self.records.append(record)
        front.gate.records_usage = True
        ids = {w.instance_id for w in self.workers}
        await wait_for(lambda: _instances(front) == ids and bool(front.keys and front.keys.by_hash))
        return front

    def client(self, key: str = SECRET) -> openai.AsyncOpenAI:
        assert self.front is not None
        return openai.AsyncOpenAI(base_url=f"{self.front.url}/v1", api_key=key, max_retries=0)


def _grant() -> tuple[str, bytes]:
    grant = Grant(workspace="default", name="team", hash=hash_secret(SECRET))
    return grant.key, grant.to_json()


def _instances(front: Frontend) -> set[int]:
    model = front.registry.models.get(MODEL)
    if model is None:
        return set()
    return {u.instance_id for ws in model.routable_sets for u in ws.routable}


@pytest.fixture
async def fleet(processes: Processes, tmp_path: Path) -> AsyncIterator[Fleet]:
    fleet = Fleet(processes, tmp_path)
    yield fleet
    if fleet.front is not None:
        await fleet.front.stop()


@pytest.fixture
async def reference() -> AsyncIterator[openai.AsyncOpenAI]:
    """An undisturbed mocker (in-process, answering at once): the texts and usage streams
    must have."""
    engine = MockerEngine(MODEL, speedup=0)
    await engine.start()
    client: TestClient[Any, Any] = TestClient(TestServer(engine.app()))
    await client.start_server()
    yield openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused")
    await client.close()
    await engine.stop()


def _messages(i: int) -> Any:
    return [{"role": "user", "content": f"Tell me story {i}."}]


async def _stream(client: openai.AsyncOpenAI, chat: bool, i: int, **extra: Any) -> dict[str, Any]:
    """One streamed chat or text completion: its text, every usage its chunks carried, and
    how many chunks had no choices."""
    if chat:
        stream: Any = await client.chat.completions.create(
            model=MODEL, messages=_messages(i), seed=i, temperature=0, max_tokens=30,
            stream=True, **extra,
        )  # fmt: skip
    else:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Once upon a time {i}", seed=i, max_tokens=30, stream=True,
            **extra,
        )  # fmt: skip
    out: dict[str, Any] = {"text": "", "usages": [], "empty": 0}
    async for chunk in stream:
        if chunk.usage is not None:
            out["usages"].append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens))
        if not chunk.choices:
            out["empty"] += 1
        for choice in chunk.choices:
            out["text"] += (choice.delta.content or "") if chat else choice.text
    return out


async def _events(front: Frontend, key: str, body: dict[str, Any]) -> list[Any]:
    """The events of a stream as the client receives them, decoded, without their `id` and
    `created` (each request's own)."""
    url = f"{front.url}/v1/chat/completions"
    headers = {"authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as response,
    ):
        assert response.status == 200
        raw = await response.read()
    assert raw.endswith(b"\n\ndata: [DONE]\n\n") and b"\n\n\n" not in raw
    events = []
    for event in raw.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: "), event
        if event != b"data: [DONE]":
            decoded = json.loads(event[6:])
            del decoded["id"], decoded["created"]
            events.append(decoded)
    return events


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
async def test_a_keys_stream_without_usage_asked_is_charged_the_engines_usage_unseen(
    fleet: Fleet, chat: bool
) -> None:
    await fleet.worker("--stream-interval", "3")  # several tokens an event, as engines batch
    await fleet.frontend()
    client = fleet.client()
    unasked = await _stream(client, chat, 1)
    asked = await _stream(client, chat, 1, stream_options={"include_usage": True})
    assert unasked["text"] == asked["text"] and unasked["text"]
    assert unasked["usages"] == [] and unasked["empty"] == 0  # no usage event, no `choices: []`
    assert asked["empty"] == 1 and len(asked["usages"]) == 1  # as before: the client's own
    (engine,) = asked["usages"]
    assert engine[1] == 30
    charged = [(r[3], r[4], r[5]) for r in fleet.records]
    assert charged == [(200, *engine), (200, *engine)]


async def test_a_client_without_a_key_and_one_with_see_the_same_stream(fleet: Fleet) -> None:
    """The stream a key's client gets, the usage asked and kept from it, is event for event
    what a request without a key gets (an operator's `--api-key`), which asks for nothing."""
    await fleet.worker("--stream-interval", "2")
    front = await fleet.frontend()
    body = {"model": MODEL, "messages": _messages(3), "seed": 3, "temperature": 0,
            "max_tokens": 11, "stream": True}  # fmt: skip
    operator, keyed = await asyncio.gather(
        _events(front, OPERATOR, body), _events(front, SECRET, body)
    )
    assert keyed == operator and len(keyed) == 8  # role, 6 of text, finish
    assert all("usage" not in event for event in keyed)
    options = {"stream_options": {"include_usage": False}}  # merged: asked, then kept from it
    assert await _events(front, SECRET, {**body, **options}) == operator
    asked = await _events(front, SECRET, {**body, "stream_options": {"include_usage": True}})
    usage = asked[-1]["usage"]
    assert asked[-1]["choices"] == [] and usage["completion_tokens"] == 11
    engine = (200, usage["prompt_tokens"], usage["completion_tokens"])
    assert [r[3:] for r in fleet.records] == [engine, engine, engine]


def _migrations(front: Frontend, outcome: str) -> float:
    samples = [s for m in front.metrics.migrations.collect() for s in m.samples]
    return sum(s.value for s in samples if s.name.endswith("_total")
               and s.labels["outcome"] == outcome)  # fmt: skip


async def _probe_until(front: Frontend, instance: Process) -> None:
    """Send one-token answers (which kill no worker) until `instance` took one: round-robin
    then sends the next request to the instance after it."""
    async with aiohttp.ClientSession() as session:
        for _ in range(10):
            body = {"model": MODEL, "prompt": "probe", "max_tokens": 1}
            headers = {"authorization": f"Bearer {OPERATOR}"}
            url = f"{front.url}/v1/completions"
            async with session.post(url, json=body, headers=headers) as response:
                assert response.status == 200
                if int(response.headers["x-shoal-instance"], 16) == instance.instance_id:
                    return
    raise AssertionError("the probe never reached the instance")


async def test_a_keys_stream_that_migrates_is_charged_once_what_the_engines_counted(
    fleet: Fleet, reference: openai.AsyncOpenAI
) -> None:
    """The option asked survives the continuation on another instance, whose usage event
    (counting every token the client got) is charged, once, and never reaches the client."""
    healthy = await fleet.worker()
    dying = await fleet.worker("--die-after-tokens", "10")
    front = await fleet.frontend(router="round-robin")
    await _probe_until(front, healthy)  # the stream starts on the dying worker
    result = await _stream(fleet.client(), True, 2)
    assert await dying.wait(10) != 0  # it did die (SIGKILL)
    undisturbed = await _stream(reference, True, 2, stream_options={"include_usage": True})
    assert result["text"] == undisturbed["text"]
    assert result["usages"] == [] and result["empty"] == 0
    assert _migrations(front, "attempted") == 1 == _migrations(front, "succeeded")
    (engine,) = undisturbed["usages"]
    assert [r[3:] for r in fleet.records] == [(200, *engine)]


async def test_only_a_keys_stream_to_the_fleet_asks_for_the_usage_never_a_provider(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """The option is asked of workers, through a virtual model too, and of a large body
    decoded in the decoder process; never of a provider (Mistral's API refuses the member
    with a 422), nor of a virtual model one of whose targets is a provider."""
    worker = await start_worker("mock-llm")
    remote = await provider("remote-model")
    try:
        await store.put(*_grant())
        front = await start_frontend(auth="keys")
        await publish_route(store, Route(workspace="default", name="alias",
                                         targets=(FleetTarget("mock-llm"),)))  # fmt: skip
        await serve_route(store, front, "remote", url_target(remote.url, "remote-model"))
        mixed = (FleetTarget("mock-llm"), url_target(remote.url, "remote-model"))
        await serve_route(store, front, "mixed", *mixed)
        keys = front.keys
        assert keys is not None
        await wait_for(lambda: "alias" in front.routes.models and bool(keys.by_hash))
        long = "word " * (LARGE_BODY // 5)
        sent: dict[str, Any] = {}
        async with openai_client(front, api_key=SECRET) as client:
            for name, content in [("mock-llm", "hi"), ("alias", "hi"), ("mock-llm", long),
                                  ("remote", "hi"), ("mixed", "hi"), ("mixed", "hi")]:  # fmt: skip
                before = len(worker.bodies), len(remote.bodies)
                stream = await client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": content}], stream=True
                )
                assert [c async for c in stream if not c.choices] == []
                (got,) = worker.bodies[before[0] :] + remote.bodies[before[1] :]
                decoded = json.loads(got)
                assert decoded["messages"][0]["content"] == content
                sent[f"{name}{len(content)}"] = decoded.get("stream_options")
            whole = await client.chat.completions.create(model="mock-llm", messages=CHAT)
            assert whole.choices
        assert "stream_options" not in json.loads(worker.bodies[-1])
        asked = {"include_usage": True}
        assert sent == {"mock-llm2": asked, "alias2": asked, f"mock-llm{len(long)}": asked,
                        "remote2": None, "mixed2": None}  # fmt: skip
    finally:
        await remote.stop()
