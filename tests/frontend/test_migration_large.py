"""A stream of a huge request migrates without holding the event loop: the continuation
is made from the client's body (up to `max_body`) in a few milliseconds, spliced as it came,
never decoded (counted: the bytes decoded into values per turn of the loop, not timed)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import msgspec
import pytest

from shoal.frontend import Frontend
from shoal.frontend.proxy import continuation
from shoal.frontend.proxy.continuation import MAX_DECODED
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import StartRaw, start_raw
from tests.frontend.support import serving
from tests.helpers import LoopTurns, wait_for

__all__ = ["start_raw"]  # the fixture

CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _events(kind: str, *pieces: str, done: bool = False) -> bytes:
    out = []
    for piece in pieces:
        if kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}}
        else:
            choice = {"index": 0, "text": piece}
        out.append({"id": "first", "created": 1, "choices": [choice]})
    data = b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in out)
    return data + (b"data: [DONE]\n\n" if done else b"")


class Script:
    """The first request streams two tokens, waits for `cut`, and dies; the next one
    (the continuation) finishes the stream. Bodies are kept as they came."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.bodies: list[bytes] = []
        self.cut = asyncio.Event()
        self.waiting = asyncio.Event()

    async def __call__(
        self, request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.bodies.append(request[request.index(b"\r\n\r\n") + 4 :])
        if len(self.bodies) > 1:
            rest = _events(self.kind, " three", done=True)
            writer.write(CHUNKED + b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
            return
        first = _events(self.kind, "one", " two")
        writer.write(CHUNKED + b"%x\r\n%s\r\n" % (len(first), first))
        await writer.drain()
        self.waiting.set()
        await self.cut.wait()
        writer.transport.abort()


async def _started(start_frontend: StartFrontend) -> Frontend:
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, "mock-llm", 2), message="model served")
    return frontend


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_migrating_a_stream_of_a_huge_request_holds_the_loop_a_few_milliseconds(
    start_raw: StartRaw, start_frontend: StartFrontend, kind: str
) -> None:
    script = Script(kind)
    await start_raw(script)
    await start_raw(script)
    frontend = await _started(start_frontend)
    huge = 'the "quick" brown fox é ' * (10_500_000 // 27)  # (27 bytes of JSON each: a 10 MB body)
    body: dict[str, Any] = {"model": "mock-llm", "stream": True, "max_tokens": 10}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": huge}]
    else:
        body["prompt"] = huge
    data = json.dumps(body, ensure_ascii=False).encode()
    assert 10_000_000 < len(data) < frontend.config.max_body
    async with aiohttp.ClientSession() as session, asyncio.timeout(30):
        path = "chat/completions" if kind == "chat" else "completions"
        sent = asyncio.create_task(session.post(f"{frontend.url}/v1/{path}", data=data))
        refused = lambda: sent.done() and sent.result().status != 200  # noqa: E731
        await wait_for(lambda: script.waiting.is_set() or refused(), timeout=20)
        assert not refused(), sent.result().status
        decoded = LoopTurns()  # bytes decoded into values, on the loop per turn
        for owner, name in [(continuation, "_decode_any"), (continuation, "_decode_list"),
                            (msgspec.json, "decode")]:  # fmt: skip
            decoded.wrap(owner, name, lambda data, *_, **__: len(data))
        script.cut.set()
        try:
            async with await sent as response:
                received = await response.read()
            await wait_for(lambda: len(script.bodies) == 2, message="continued")
        finally:
            await decoded.stop()
    assert received.endswith(b"data: [DONE]\n\n"), received[-200:]
    continued = json.loads(script.bodies[1])
    if kind == "chat":
        assert continued["messages"] == [
            {"role": "user", "content": huge},
            {"role": "assistant", "content": "one two"},
        ]
    else:
        assert continued["prompt"] == huge + "one two"
    most = decoded.most_per_turn
    assert most <= MAX_DECODED, f"{most} bytes decoded in one turn of the loop"
