"""Upstreams made of raw asyncio servers, for misbehaviour an HTTP library would hide
(a head cut in half, a stall mid-body, interim responses, odd headers)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from shoal.discovery import InstanceInfo
from shoal.store import Store
from tests.frontend.support import FakeWorker

# Given the raw request (head and body) and the connection: answer however the test wants.
Behaviour = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawUpstream(FakeWorker):
    """A worker whose OpenAI endpoint is a raw socket server running `behaviour`.

    Its metadata files are still served by the `FakeWorker` it extends, so the frontend
    verifies its card as usual; only the request URL it announces points at the raw server.
    """

    def __init__(self, behaviour: Behaviour) -> None:
        super().__init__()
        self.behaviour = behaviour
        self.userinfo = ""  # e.g. "user:pass@", announced in the request URL
        self.raw_requests: list[bytes] = []
        self.open_connections = 0
        self._raw: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def raw_port(self) -> int:
        assert self._raw is not None
        return int(self._raw.sockets[0].getsockname()[1])

    @property
    def raw_url(self) -> str:
        return f"http://{self.userinfo}127.0.0.1:{self.raw_port}"

    async def start(self) -> RawUpstream:
        await super().start()
        self._raw = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    def stop_listening(self) -> None:
        """Refuse new connections from now on (the process died), the open ones kept."""
        if self._raw is not None:
            self._raw.close()

    async def stop(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        if self._raw is not None:
            self._raw.close()
            self._raw = None
        await super().stop()

    def info(self) -> InstanceInfo:
        return InstanceInfo(
            self.namespace, self.component, "generate", self.instance_id,
            f"{self.raw_url}/v1", self.url,
        )  # fmt: skip

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self.open_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                request = head + await reader.readexactly(length)
                self.raw_requests.append(request)
                self.requests += 1
                await self.behaviour(request, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open_connections -= 1
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()


async def until_closed(reader: asyncio.StreamReader) -> None:
    """Send nothing more: wait until the gateway drops the connection."""
    while await reader.read(65536):
        pass


def completion(text: str = "hi", *, extra_headers: bytes = b"") -> bytes:
    """A complete non-streamed chat completion response, keep-alive."""
    body = (
        b'{"id":"x","object":"chat.completion","created":1,"model":"mock-llm","choices":'
        b'[{"index":0,"message":{"role":"assistant","content":"' + text.encode() + b'"},'
        b'"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
        b'"total_tokens":2}}'
    )
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + extra_headers
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )


def json_answer(status: bytes, body: bytes) -> Behaviour:
    """A behaviour answering every request `status` (e.g. b"400 Bad Request") with the JSON
    `body`, keep-alive."""

    async def answer(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, len(body), body)
        )

    return answer


def endless(start: bytes, piece: bytes, sent: list[int]) -> Behaviour:
    """A behaviour answering `start` then `piece` again and again, up to 256 MiB (a head or
    framing without end), appending to `sent` how many bytes of pieces it got out."""

    async def answer(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        total = 0
        writer.write(start)
        try:
            while total < 256 << 20:
                writer.write(piece * 64)
                total += len(piece) * 64
                await writer.drain()
        finally:
            sent.append(total)

    return answer


StartRaw = Callable[..., Awaitable[RawUpstream]]


@pytest.fixture
async def start_raw(store: Store) -> AsyncIterator[StartRaw]:
    """Start a `RawUpstream` with a behaviour and announce it in discovery."""
    started: list[RawUpstream] = []

    async def start(behaviour: Behaviour, userinfo: str = "") -> RawUpstream:
        upstream = await RawUpstream(behaviour).start()
        upstream.userinfo = userinfo
        started.append(upstream)
        await upstream.register(store)
        return upstream

    yield start
    for upstream in started:
        await upstream.stop()
        if upstream.lease is not None:
            with contextlib.suppress(Exception):
                await upstream.lease.revoke()
