"""What the fault-injection tests share: a TCP proxy that can cut or stall the store's traffic,
a client load that records every outcome, fake instances that misbehave, and the report rows
that `docs/reliability.md` tabulates."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam

from shoal.cards import ModelCard
from shoal.discovery import Discovery, EndpointId, InstanceInfo, ModelKey, Query
from shoal.store import Lease, Store
from tests.helpers import wait_for

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
# Workers of these tests: fast, and their lease ends 2 s after they die.
LEASE_TTL = 2.0
FAST = ("--lease-ttl", f"{LEASE_TTL:g}", "--ttft-ms", "5", "--itl-ms", "2")
RECONCILE_INTERVAL = 1.0


class TcpProxy:
    """A loopback TCP proxy in front of `target`: `cut()` closes every connection and refuses
    new ones, `stall()` keeps connections open but forwards nothing, `heal()` restores."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.mode = "pass"
        self.healed = asyncio.Event()
        self.healed.set()
        self.server: asyncio.Server | None = None
        self.links: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def start(self) -> TcpProxy:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.links |= {writer, up_writer}
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 16):
                await self.healed.wait()  # stalled: hold the bytes
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.links.discard(dst)
            dst.transport.abort()

    def cut(self) -> None:
        self.mode = "cut"
        for link in list(self.links):
            link.transport.abort()
        self.links.clear()

    def stall(self) -> None:
        self.mode = "stall"
        self.healed.clear()

    def heal(self) -> None:
        self.mode = "pass"
        self.healed.set()

    async def close(self) -> None:
        self.heal()
        if self.server is not None:
            self.server.close()
        for link in list(self.links):
            link.transport.abort()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Load:
    """Official `openai` clients in a loop, streaming and not, recording every outcome.

    `urls` are frontends: a client whose frontend refuses the connection retries once at the
    next one, as a client behind a load balancer would.
    """

    def __init__(self, urls: list[str], clients: int = 8, model: str = "mock-llm") -> None:
        self.clients = [
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            for url in urls
        ]
        self.model = model
        self.concurrency = clients
        self.stop = asyncio.Event()
        self.sent = 0
        self.ok = 0
        self.failed_before_first_byte: list[str] = []
        self.failed_mid_stream: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def _one(self, n: int, stream: bool) -> None:
        for attempt in range(len(self.clients)):
            client = self.clients[(n + attempt) % len(self.clients)]
            received = 0
            self.sent += 1
            try:
                if stream:
                    chunks = await client.chat.completions.create(
                        model=self.model, messages=CHAT, max_tokens=20, stream=True
                    )
                    async for _ in chunks:
                        received += 1
                else:
                    await client.chat.completions.create(
                        model=self.model, messages=CHAT, max_tokens=20
                    )
                self.ok += 1
                return
            except openai.APIConnectionError as exc:
                if received:
                    self.failed_mid_stream.append(repr(exc))
                    return
                if attempt + 1 == len(self.clients):
                    self.failed_before_first_byte.append(repr(exc))
                self.sent -= 1  # never reached a frontend: sent again to the next one
            except openai.APIStatusError as exc:
                # A frontend still loading its fleet answers 503 with Retry-After (it is not
                # ready): retried once at the next one, as a refused connection is.
                loading = exc.status_code == 503 and "still loading" in str(exc)
                if loading and not received and attempt + 1 < len(self.clients):
                    self.sent -= 1
                    continue
                (self.failed_mid_stream if received else self.failed_before_first_byte).append(
                    repr(exc)
                )
                return
            except openai.APIError as exc:
                (self.failed_mid_stream if received else self.failed_before_first_byte).append(
                    repr(exc)
                )
                return

    async def _loop(self, n: int) -> None:
        while not self.stop.is_set():
            await self._one(n, stream=bool(n % 2))

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._loop(n)) for n in range(self.concurrency)]

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)
        for client in self.clients:
            await client.close()

    async def advance(self, requests: int, timeout: float = 20.0) -> None:
        """Wait until `requests` more requests succeeded."""
        target = self.ok + requests
        await until(lambda: self.ok >= target, timeout, f"{requests} more requests answered")


async def until(
    condition: Callable[[], Any | Awaitable[Any]], timeout: float, message: str
) -> float:
    """Seconds until `condition` held (`tests.helpers.wait_for`); the time is a figure we
    report."""
    started = time.monotonic()
    await wait_for(condition, timeout, message=message)
    return time.monotonic() - started


async def instance_ids(frontend_url: str, model: str = "mock-llm") -> set[int]:
    """The instances a frontend process routes `model` to, from its `/health`."""
    import aiohttp

    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{frontend_url}/health") as response,
    ):
        body = await response.json()
    entry = body.get("models", {}).get(model)
    if not entry:
        return set()
    return {int(i, 16) for ws in entry["worker_sets"] for i in ws["instances"]}


async def routes_exactly(frontend_url: str, expected: set[int]) -> bool:
    """The frontend routes `mock-llm` to exactly the instances `expected`."""
    return await instance_ids(frontend_url) == expected


async def copy_card(store: Store, namespace: str, url: str) -> tuple[ModelKey, Lease]:
    """Register, under a lease of its own, an instance at `url` serving the very card of a live
    mocker in `namespace`: it joins that mocker's worker set, and misbehaves however the
    server at `url` does."""
    discovery = Discovery(store)
    listed = await discovery.list(Query(namespace=namespace))
    assert listed, f"no live card in {namespace} to copy"
    return await register_card(store, listed[0].key.endpoint, listed[0].card, url)


async def register_card(
    store: Store, endpoint: EndpointId, card: ModelCard, url: str
) -> tuple[ModelKey, Lease]:
    """Register `card` at an instance of `endpoint` whose requests go to `url`."""
    discovery = Discovery(store)
    lease = await store.grant(30)
    key = ModelKey(endpoint, lease.id)
    info = InstanceInfo(
        endpoint.namespace, endpoint.component, endpoint.endpoint, lease.id, f"{url}/v1", url
    )
    await discovery.register_instance(info, lease=lease.id)
    await discovery.register_model(key, card, lease=lease.id)
    return key, lease


@dataclass
class Row:
    """One line of the reliability table."""

    case: str
    backend: str
    sent: int = 0
    failed: int = 0
    failed_mid_stream: int = 0
    converge_seconds: float = 0.0
    ghosts: int = 0
    command: str = ""
    notes: list[str] = field(default_factory=list)

    def record(self) -> None:
        """Append to `$SHOAL_RELIABILITY_REPORT` (JSON lines) when set; always print."""
        line = json.dumps(asdict(self))
        print(f"\nreliability: {line}")
        target = os.environ.get("SHOAL_RELIABILITY_REPORT")
        if target:
            with Path(target).open("a") as out:
                out.write(line + "\n")
