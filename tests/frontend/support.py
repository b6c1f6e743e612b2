"""Test support for the frontend: a fake OpenAI worker, a discovery that drops chosen events,
and helpers to start a frontend in-process."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import hashlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from aiohttp import web

from shoal.cards import ModelCard, WorkerRole, slugify
from shoal.discovery import (
    Discovery,
    DiscoveryEvent,
    EndpointId,
    InstanceInfo,
    ModelInstance,
    ModelKey,
    Query,
)
from shoal.store import Lease, Store
from tests.helpers import Server

_ids = itertools.count(1)


class FakeWorker:
    """An OpenAI-compatible HTTP server that also hosts its model's metadata files.

    Knobs: `fail_next` answers that many requests with 500; `stream_delay` spaces SSE
    chunks; `die_after_chunks` drops the connection mid-stream; `metadata_failures` fails
    that many metadata fetches; `metadata_hang` makes metadata fetches hang until cleared;
    `head_delay` holds each answer back that long; `answering` cleared makes the worker read
    requests and never answer them (until it is set again); `role` is its card's (a stage of
    disaggregated serving); `echo_request_id` answers the request's `X-Request-Id` (as vLLM
    does with `--enable-request-id-headers`).
    """

    def __init__(
        self,
        model: str = "mock-llm",
        *,
        namespace: str = "default",
        component: str = "backend",
        version: str = "1",
        lora_of: str | None = None,
        model_types: tuple[str, ...] = ("chat", "completions", "embeddings"),
        role: WorkerRole = WorkerRole.AGGREGATED,
        max_body: int = 1 << 20,
    ) -> None:
        self.model = model
        self.max_body = max_body  # bytes of a request body it reads (more: 413)
        self.role = role
        self.echo_request_id = False
        self.namespace = namespace
        self.component = component
        self.version = version
        self.lora_of = lora_of
        self.model_types = model_types
        self.metadata = f'{{"model": "{model}", "version": "{version}"}}'.encode()
        self.fail_next = 0
        self.fail_status = 500
        self.stream_delay = 0.0
        self.stream_chunks = 3
        self.stream_padding = 0  # bytes of padding in each SSE chunk
        self.chunks_sent = 0
        self.die_after_chunks: int | None = None
        self.delta_extra: dict[str, Any] = {}  # added to each streamed chat delta (tool calls)
        self.runtime_config: dict[str, Any] = {}  # the card's
        self.metadata_failures = 0
        self.metadata_hang = asyncio.Event()
        self.metadata_hang.set()  # set = not hanging
        self.metadata_fetches = 0
        self.head_delay = 0.0
        self.answering = asyncio.Event()
        self.answering.set()  # set = answering
        self.requests = 0
        self.in_flight = 0
        self.cancelled = 0
        self.bodies: list[bytes] = []
        self.headers: list[Any] = []  # case-insensitive multidicts
        self.port = 0
        self._server: Server | None = None
        self.lease: Lease | None = None
        self.discovery: Discovery | None = None
        self.instance_id = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> EndpointId:
        return EndpointId(self.namespace, self.component, "generate")

    @property
    def key(self) -> ModelKey:
        return ModelKey(self.endpoint, self.instance_id)

    async def start(self) -> FakeWorker:
        app = web.Application(client_max_size=self.max_body)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/metadata/{name}", self._metadata)
        self._server = Server(app, port=0)
        await self._server.start()
        self.port = self._server.port
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
            self._server = None

    def card(self) -> ModelCard:
        fields: dict[str, Any] = {
            "display_name": self.model,
            "slug": slugify(self.model),
            "source": f"test/{self.model}",
            "model_types": list(self.model_types),
            "context_length": 4096,
            "runtime_config": self.runtime_config,
            "role": self.role,
            "metadata_files": {
                "config.json": {
                    "url": f"{self.url}/metadata/config.json",
                    "checksum": "sha256:" + hashlib.sha256(self.metadata).hexdigest(),
                    "size": len(self.metadata),
                }
            },
        }
        if self.lora_of is not None:
            fields["lora"] = {"base_model": self.lora_of, "adapter": f"adapters/{self.model}"}
        return ModelCard.build(**fields)

    def info(self) -> InstanceInfo:
        return InstanceInfo(
            self.namespace,
            self.component,
            "generate",
            self.instance_id,
            f"{self.url}/v1",
            self.url,
        )

    def model_instance(self) -> ModelInstance:
        return ModelInstance(self.key, self.card(), self.info())

    async def register(self, store: Store, *, ttl: float = 10.0) -> None:
        """Announce this worker in discovery under a lease of its own."""
        self.discovery = Discovery(store)
        self.lease = await store.grant(ttl)
        self.instance_id = self.lease.id
        await self.discovery.register_instance(self.info(), lease=self.lease.id)
        await self.discovery.register_model(self.key, self.card(), lease=self.lease.id)

    async def unregister(self) -> None:
        assert self.discovery is not None
        await self.discovery.unregister_model(self.key)
        await self.discovery.unregister_instance(self.endpoint, self.instance_id)

    async def taint(self, *taints: str) -> None:
        assert self.discovery is not None
        await self.discovery.update_taints(self.key, taints)

    # -- handlers ----------------------------------------------------------------------------

    async def _metadata(self, request: web.Request) -> web.Response:
        self.metadata_fetches += 1
        await self.metadata_hang.wait()
        if self.metadata_failures > 0:
            self.metadata_failures -= 1
            return web.Response(status=503, text="not yet")
        return web.Response(body=self.metadata, content_type="application/json")

    def _failing(self) -> web.Response | None:
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response(
                {"error": {"message": "injected failure", "type": "server_error"}},
                status=self.fail_status,
            )
        return None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat.completion")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "text_completion")

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.read()
        self.bodies.append(body)
        if (failure := self._failing()) is not None:
            return failure
        return web.json_response(
            {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
                "model": json.loads(body)["model"],
                "usage": {"prompt_tokens": 1, "total_tokens": 1},
            }
        )

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        self.requests += 1
        body = await request.read()
        self.bodies.append(body)
        self.headers.append(request.headers.copy())
        if self.head_delay:
            await asyncio.sleep(self.head_delay)  # a slow upstream's head
        await self.answering.wait()
        if (failure := self._failing()) is not None:
            return failure
        data = json.loads(body)
        text = f"hello from {self.instance_id:x}"
        echoed = request.headers.get("x-request-id") if self.echo_request_id else None
        headers = {"X-Request-Id": echoed} if echoed is not None else {}
        self.in_flight += 1
        try:
            if data.get("stream"):
                return await self._stream(request, data["model"], kind, text, headers)
            await asyncio.sleep(self.stream_delay * self.stream_chunks)  # a slow answer
            return web.json_response(_completion(kind, data["model"], text), headers=headers)
        except (asyncio.CancelledError, ConnectionError):
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    async def _stream(
        self, request: web.Request, model: str, kind: str, text: str, headers: dict[str, str]
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await response.prepare(request)
        for i in range(self.stream_chunks):
            if self.die_after_chunks is not None and i == self.die_after_chunks:
                assert request.transport is not None
                request.transport.abort()
                return response
            piece = text if i == 0 else f" {i}"
            chunk = _chunk(kind, model, piece)
            if self.delta_extra and "delta" in chunk["choices"][0]:
                chunk["choices"][0]["delta"].update(self.delta_extra)
            if self.stream_padding:
                chunk["padding"] = "x" * self.stream_padding
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.chunks_sent += 1
            if self.stream_delay:
                await asyncio.sleep(self.stream_delay)  # a slow stream's pace
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _completion(kind: str, model: str, text: str) -> dict[str, Any]:
    if kind == "text_completion":
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "finish_reason": "stop",
            "logprobs": None,
        }
    else:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
    return {
        "id": f"cmpl-{next(_ids)}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
    }


def _chunk(kind: str, model: str, text: str) -> dict[str, Any]:
    if kind == "text_completion":
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": None}
        obj = "text_completion"
    else:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": text},
            "finish_reason": None,
        }
        obj = "chat.completion.chunk"
    return {
        "id": "chunk",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


class FilteringDiscovery(Discovery):
    """A discovery whose event stream drops the events `drop` says to, and whose `list`
    can be made to fail: the missed events and flaky stores reconciliation must repair."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.drop: Callable[[DiscoveryEvent], bool] = lambda event: False
        self.dropped: list[DiscoveryEvent] = []
        self.list_failures = 0
        self.list_calls = 0
        self.hold_listings: asyncio.Event | None = None  # listings return once it is set

    async def list_and_watch(
        self,
        query: Query | None = None,
        *,
        after_listing: bool = False,
        on_listed: Callable[[], None] | None = None,
    ) -> AsyncIterator[DiscoveryEvent]:
        stream = super().list_and_watch(query, after_listing=after_listing, on_listed=on_listed)
        async for event in stream:
            if self.drop(event):
                self.dropped.append(event)
                continue
            yield event

    async def list(
        self, query: Query | None = None, *, on_answer: Callable[[], None] | None = None
    ) -> list[ModelInstance]:
        self.list_calls += 1
        if self.list_failures > 0:
            self.list_failures -= 1
            raise ConnectionError("injected discovery failure")
        listed = await super().list(query, on_answer=on_answer)
        if self.hold_listings is not None:
            await self.hold_listings.wait()  # the listing goes stale meanwhile
        return listed


async def raw_exchange(
    port: int, data: bytes, *, responses: int = 1, timeout: float = 5.0
) -> bytes:
    """Write raw bytes to the server and read until `responses` complete responses arrived
    (by Content-Length or chunked framing) or the server closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        received = b""
        async with asyncio.timeout(timeout):
            while count_responses(received) < responses:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                received += chunk
        return received
    finally:
        writer.close()


def count_responses(data: bytes) -> int:
    """How many complete HTTP/1.1 responses `data` holds (100 Continue not counted)."""
    count = 0
    while True:
        head_end = data.find(b"\r\n\r\n")
        if head_end < 0:
            return count
        head = data[:head_end].decode("latin-1").lower()
        rest = data[head_end + 4 :]
        if head.startswith("http/1.1 100"):
            data = rest
            continue
        if "transfer-encoding: chunked" in head:
            end = rest.find(b"0\r\n\r\n")
            if end < 0:
                return count
            data = rest[end + 5 :]
        else:
            length = 0
            for line in head.split("\r\n"):
                if line.startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            if len(rest) < length:
                return count
            data = rest[length:]
        count += 1


def serving(frontend: Any, model: str = "mock-llm", instances: int = 1) -> bool:
    """True once `model` is served with at least `instances` live instances."""
    entry = frontend.registry.models.get(model)
    return entry is not None and entry.serving and entry.live_instances >= instances


def _shoals(obj: object) -> bool:
    module = getattr(type(obj), "__module__", None)  # (a descriptor on some built-in types)
    return isinstance(module, str) and module.startswith("shoal.")


@contextlib.contextmanager
def shoal_cycles() -> Iterator[collections.Counter[str]]:
    """The types of shoal's objects left in reference cycles while the block ran (the
    collector off meanwhile): only shoal's, the event loop's own (the selector loop's closed
    transports) are not the request path's to break. Objects alive before the block are not
    its own: an earlier test's (its event loop, closed and let go while this block ran, and
    the connections it held) were counted when that test's order put them here."""
    found: collections.Counter[str] = collections.Counter()
    gc.collect()
    earlier = {id(o) for o in gc.get_objects() if _shoals(o)}
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        for obj in gc.garbage:
            kind = type(obj)
            if _shoals(obj) and id(obj) not in earlier:
                found[kind.__qualname__] += 1
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
