"""A stream whose instance fails goes on at another instance of its set even when that one is
inhibited (a recent failure of another request): as a new request would be sent there as a
last resort, never refused while an instance is left."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from shoal.frontend import Frontend
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import StartRaw, start_raw
from tests.frontend.support import serving
from tests.frontend.test_migration_splice import CHUNKED, CONTINUATION, FIRST
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture


class Gated:
    """The first request gets the start of a stream, then, once `cut` is set, a lost
    connection; later ones get the continuation."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.cut = asyncio.Event()

    async def __call__(
        self, request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.bodies.append(json.loads(request.split(b"\r\n\r\n", 1)[1]))
        if len(self.bodies) > 1:
            writer.write(CHUNKED + b"%x\r\n%s\r\n0\r\n\r\n" % (len(CONTINUATION), CONTINUATION))
            return
        writer.write(CHUNKED + b"%x\r\n%s\r\n" % (len(FIRST), FIRST))
        await writer.drain()
        await self.cut.wait()
        writer.transport.abort()


async def test_a_stream_continues_on_the_only_other_instance_though_it_is_inhibited(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """Two instances, the other inhibited while the stream runs (it failed another request a
    moment ago): the stream's instance dies, and the migration found no instance (`pick`
    leaves inhibited ones out) and broke the stream off, where a new request would have been
    sent to it. It is now continued there."""
    script = Gated()
    await start_raw(script)
    await start_raw(script)
    frontend: Frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, "mock-llm", 2), message="model served")
    body = {
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "Tell me"}],
        "max_tokens": 10,
        "stream": True,
    }
    model = frontend.registry.models["mock-llm"]
    url = f"{frontend.url}/v1/chat/completions"
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(url, json=body) as response,
    ):
        assert response.status == 200
        await response.content.readuntil(b"upon")  # the stream runs on one instance
        (other,) = [u for ws in model.routable_sets for u in ws.routable if not u.in_flight]
        other.inhibit(30.0)  # (it failed another request a moment ago)
        script.cut.set()
        received = await response.read()
    assert b"a time" in received and received.endswith(b"data: [DONE]\n\n"), received
    assert len(script.bodies) == 2
