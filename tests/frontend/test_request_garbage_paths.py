"""Every request path leaves nothing for the garbage collector: the proof of
test_request_garbage.py (which drives the round-robin path over fake transports), through an
in-process frontend over real sockets on uvloop (`shoal frontend`'s loop), for each way in
and each way out: an operator's key and a team's (`--auth keys`: the gate, its limits and
the usage book), virtual models (an alias, a weighted split, an external provider), the
other endpoints, the worker's errors, a first-byte timeout, a stream that migrates, a client
that leaves mid-stream. Only shoal's objects are counted (`shoal_cycles`).

Log records name what they report, and pytest keeps the records a test logs: the gateway's
are not made here (`quiet`), or they would keep alive what they name."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from shoal.discovery import FleetTarget, Route, UrlTarget, publish_route
from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import FakeWorker, count_responses, serving, shoal_cycles
from tests.helpers import wait_for

REQUESTS = 6
TEAM = "sk-shoal-" + "t" * 43
OPERATOR = "sk-operator"
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**CHAT, "stream": True, "max_tokens": 50}
# (past `fields.LARGE_BODY`: its fields, and an alias' members, decoded in a thread)
LARGE = {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 12_000}


pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])  # as `shoal frontend` runs


@pytest.fixture
def quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="shoal")


class Client:
    """Requests one after the other on one keep-alive connection, as the raw bytes go."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, method: str, path: str, body: Any = None, key: str = OPERATOR) -> int:
        """The answer's status (the answer read whole)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        self.writer.write(request(method, path, body, key))
        received = b""
        async with asyncio.timeout(10):
            while count_responses(received) < 1:
                data = await self.reader.read(65536)
                assert data, f"the connection closed: {received!r}"
                received += data
        if b"\r\nconnection: close\r\n" in received.partition(b"\r\n\r\n")[0] + b"\r\n":
            self.close()  # (a request refused on its head: its body unread, the connection ends)
            self.writer = None
        return int(received[9:12])

    async def leave_mid_stream(self, body: Any) -> None:
        """Send a stream's request on a connection of its own, leave after its first event."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(request("POST", "/v1/chat/completions", body, OPERATOR))
        received = b""
        async with asyncio.timeout(10):
            while b"data:" not in received:
                data = await reader.read(65536)
                assert data, received
                received += data
        writer.transport.abort()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def request(method: str, path: str, body: Any, key: str) -> bytes:
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    return (
        f"{method} {path} HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode() + data


async def fleet(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend, tmp_path: Path
) -> tuple[Frontend, list[FakeWorker]]:
    """Two instances of mock-llm, an external provider, routes to both, a team's key with
    limits (this frontend's windows) and the usage book."""
    workers = [await start_worker("mock-llm"), await start_worker("mock-llm")]
    provider = await start_worker("remote-llm", register=False)
    made = Grant(workspace="default", name="team", hash=hash_secret(TEAM), rpm=10**6,
                 tpm=10**9, max_parallel=100)  # fmt: skip
    await store.put(made.key, made.to_json())
    routes = {
        "alias": (FleetTarget("mock-llm"),),
        "split": (FleetTarget("mock-llm", weight=3), FleetTarget("mock-llm", weight=1)),
        "remote": (UrlTarget(base_url=f"{provider.url}/v1", model="remote-llm"),),
    }
    for name, targets in routes.items():
        await publish_route(store, Route(workspace="default", name=name, targets=targets))
    frontend = await start_frontend(
        reconcile_interval=3600, auth="keys", api_keys=(OPERATOR,), inhibit_seconds=0.001,
        first_byte_timeout=1.0, catalog_url="http://127.0.0.1:9", usage_interval=3600,
    )  # fmt: skip
    keys = frontend.keys
    assert keys is not None
    await wait_for(lambda: serving(frontend, instances=2) and keys.by_hash, message="served")
    await wait_for(lambda: all(n in frontend.routes.models for n in routes), message="routed")
    return frontend, [*workers, provider]


async def test_no_request_path_leaves_a_cycle(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    tmp_path: Path,
    quiet: None,
) -> None:
    frontend, (one, two, provider) = await fleet(store, start_worker, start_frontend, tmp_path)
    client = Client(frontend.port)

    def posts(path: str, body: Any, key: str = OPERATOR) -> Callable[[], Awaitable[int]]:
        return lambda: client.send("POST", path, body, key)

    def gets(*paths: str) -> Callable[[], Awaitable[int]]:
        async def each() -> int:
            statuses = {await client.send("GET", path) for path in paths}
            assert len(statuses) == 1, statuses
            return statuses.pop()

        return each

    async def failing(status: int, body: Any = CHAT, workers: tuple[FakeWorker, ...] = ()) -> int:
        """Each of `workers` (both by default) answers the next request `status`."""
        for worker in workers or (one, two):
            worker.fail_next, worker.fail_status = 1, status
        try:
            return await client.send("POST", "/v1/chat/completions", body)
        finally:
            one.fail_next = two.fail_next = 0

    async def silent() -> int:
        one.answering.clear()  # (one of two requests waits there, then goes to the other)
        try:
            return await client.send("POST", "/v1/chat/completions", CHAT)
        finally:
            one.answering.set()

    async def migrating() -> int:
        one.die_after_chunks = 2  # (one of two streams lands there, and moves to the other)
        try:
            return await client.send("POST", "/v1/chat/completions", STREAM)
        finally:
            one.die_after_chunks = None

    async def leaving() -> int:
        for worker in (one, two):
            worker.stream_delay, worker.stream_chunks = 0.01, 20
        try:
            await client.leave_mid_stream(STREAM)
            # (the gateway answered for the request: it left the in-flight gauge)
            await wait_for(lambda: frontend.metrics.model("mock-llm").in_flight == 0)
        finally:
            for worker in (one, two):
                worker.stream_delay, worker.stream_chunks = 0.0, 3
        return 200

    chat, completions = "/v1/chat/completions", "/v1/completions"
    paths: dict[str, tuple[Callable[[], Awaitable[int]], int]] = {
        "chat": (posts(chat, CHAT), 200),
        "stream": (posts(chat, STREAM), 200),
        "completions": (posts(completions, {"model": "mock-llm", "prompt": "hi"}), 200),
        "completions stream": (
            posts(completions, {"model": "mock-llm", "prompt": "hi", "stream": True}),
            200,
        ),
        "embeddings": (posts("/v1/embeddings", {"model": "mock-llm", "input": "hi"}), 200),
        "team key chat": (posts(chat, CHAT, TEAM), 200),
        "team key stream": (posts(chat, STREAM, TEAM), 200),
        "team key, another's model": (posts(chat, {**CHAT, "model": "none"}, TEAM), 404),
        "unknown key": (posts(chat, CHAT, "sk-nobody"), 401),
        "alias": (posts(chat, {**CHAT, "model": "alias"}), 200),
        "weighted split stream": (posts(chat, {**STREAM, "model": "split"}), 200),
        "provider": (posts(chat, {**CHAT, "model": "remote"}), 200),
        "provider stream": (posts(chat, {**STREAM, "model": "remote"}), 200),
        "models, health, metrics": (
            gets("/v1/models", "/v1/models/mock-llm", "/health", "/metrics", "/live", "/ready"),
            200,
        ),
        "unknown model": (posts(chat, {**CHAT, "model": "none"}), 404),
        "not JSON": (posts(chat, b"{"), 400),
        "large chat": (posts(chat, LARGE), 200),
        "team key large chat": (posts(chat, LARGE, TEAM), 200),
        "large alias": (posts(chat, {**LARGE, "model": "alias"}), 200),
        "team key large, not JSON": (posts(chat, json.dumps(LARGE).encode()[:-1], TEAM), 400),
        "worker 4xx": (lambda: failing(400), 400),
        # (round-robin: every other request is retried on the instance that did not fail)
        "worker 5xx, retried": (lambda: failing(500, workers=(one,)), 200),
        "worker 5xx, stream retried": (lambda: failing(503, STREAM, (one,)), 200),
        "worker 5xx on both, relayed": (lambda: failing(500), 500),
        "first-byte timeout, retried": (silent, 200),
        "stream migrates": (migrating, 200),
        "client leaves mid-stream": (leaving, 200),
    }
    left: dict[str, Any] = {}
    try:
        for name, (serve, status) in paths.items():
            n = 2 if serve is silent else REQUESTS  # (a second each: one of two waits)
            for _ in range(2):  # (what the first requests make once: the pool, caches)
                assert await serve() == status, name
            with shoal_cycles() as found:
                for _ in range(n):
                    assert await serve() == status, name
            if found:
                left[name] = dict(found)
    finally:
        client.close()
    assert not left, f"requests of these paths left cycles: {left}"
    assert provider.requests >= REQUESTS and one.requests and two.requests
