"""The splice of a migrated stream, byte by byte: whatever way the first instance fails
(silence past the idle timeout, an end before `[DONE]`, a lost connection), the
continuation is asked for the text so far and its events join the client's stream under
the first one's `id` and `created`, its role chunk dropped, its usage counting every token."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest

from shoal.frontend import Frontend
from shoal.frontend.proxy import continuation
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import StartRaw, start_raw, until_closed
from tests.frontend.support import serving
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture

FIRST = (
    b'data: {"id":"chatcmpl-first","object":"chat.completion.chunk","created":111,'
    b'"model":"mock-llm","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    b"\n\n"
    b'data: {"id":"chatcmpl-first","object":"chat.completion.chunk","created":111,'
    b'"model":"mock-llm","choices":[{"index":0,"delta":{"content":"Once"}}]}\n\n'
    b'data: {"id":"chatcmpl-first","object":"chat.completion.chunk","created":111,'
    b'"model":"mock-llm","choices":[{"index":0,"delta":{"content":" upon"}}]}\n\n'
    b'data: {"id":"chatcmpl-first","object":"chat.comp'  # half an event, then the failure
)
CONTINUATION = (
    b'data: {"id":"chatcmpl-second","object":"chat.completion.chunk","created":222,'
    b'"model":"mock-llm","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    b"\n\n"
    b'data: {"id":"chatcmpl-second","object":"chat.completion.chunk","created":222,'
    b'"model":"mock-llm","choices":[{"index":0,"delta":{"content":" a time"}}]}\n\n'
    b'data: {"id":"chatcmpl-second","object":"chat.completion.chunk","created":222,'
    b'"model":"mock-llm","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"chatcmpl-second","object":"chat.completion.chunk","created":222,'
    b'"model":"mock-llm","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":1,'
    b'"total_tokens":13}}\n\n'
    b"data: [DONE]\n\n"
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


class Script:
    """The first request fails as `how` says; later ones get the continuation."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.bodies: list[dict[str, Any]] = []

    async def __call__(
        self, request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.bodies.append(json.loads(request.split(b"\r\n\r\n", 1)[1]))
        if len(self.bodies) > 1:
            writer.write(CHUNKED + b"%x\r\n%s\r\n0\r\n\r\n" % (len(CONTINUATION), CONTINUATION))
            return
        if self.how == "eof":  # no length, not chunked: the body ends with the connection
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + FIRST)
            await writer.drain()
            writer.close()
            return
        if self.how == "sized":  # framed by a Content-Length, then cut short
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(FIRST) + 500, FIRST)
            )
            await writer.drain()
            writer.transport.abort()
            return
        # (partial: half an event; ping: a keep-alive comment, no event)
        first = {"partial": FIRST[:20], "ping": b": keep-alive\n\n"}.get(self.how, FIRST)
        writer.write(CHUNKED + b"%x\r\n%s\r\n" % (len(first), first))
        await writer.drain()
        if self.how in ("lost", "partial", "ping"):
            writer.transport.abort()
            return
        await until_closed(reader)  # idle_timeout: silence


async def _started(start_frontend: StartFrontend, **settings: Any) -> Frontend:
    frontend = await start_frontend(**settings)
    await wait_for(lambda: serving(frontend, "mock-llm", 2), message="model served")
    return frontend


@pytest.mark.parametrize("how", ["idle_timeout", "eof", "lost"])
async def test_a_failed_stream_continues_on_another_instance_as_one_stream(
    start_raw: StartRaw, start_frontend: StartFrontend, how: str
) -> None:
    script = Script(how)
    await start_raw(script)
    await start_raw(script)
    frontend = await _started(start_frontend, upstream_idle_timeout=0.3)
    body = {
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "Tell me"}],
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 200
        received = await response.read()
    events = [e[len(b"data: ") :] for e in received.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {(c["id"], c["created"]) for c in chunks} == {("chatcmpl-first", 111)}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert [d.get("role") for d in deltas].count("assistant") == 1
    assert "".join(d.get("content") or "" for d in deltas) == "Once upon a time"
    assert chunks[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    first, continuation = script.bodies
    assert continuation["messages"] == [
        *first["messages"],
        {"role": "assistant", "content": "Once upon"},
    ]
    assert continuation["continue_final_message"] is True
    assert continuation["add_generation_prompt"] is False
    assert continuation["max_tokens"] == 8
    value = frontend.metrics.registry.get_sample_value(
        "shoal_frontend_migrations_total", {"outcome": "succeeded", "reason": how}
    )
    assert value == 1
    splices = frontend.metrics.registry.get_sample_value(
        "shoal_frontend_migration_splice_seconds_count"
    )
    assert splices == 1


async def test_a_stream_that_failed_before_its_first_whole_event_gets_the_continuation_whole(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    script = Script("partial")
    await start_raw(script)
    await start_raw(script)
    frontend = await _started(start_frontend)
    body = {
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "Tell me"}],
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        received = await response.read()
    events = [e[len(b"data: ") :] for e in received.split(b"\n\n") if e]
    chunks = [json.loads(e) for e in events[:-1]]
    assert {(c["id"], c["created"]) for c in chunks} == {("chatcmpl-second", 222)}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"  # the one role chunk
    assert script.bodies[1] == script.bodies[0]  # nothing to continue: the request afresh


async def test_a_stream_that_finished_without_done_is_not_continued(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    finished = CONTINUATION[: CONTINUATION.index(b"data: [DONE]")]  # finish reason, no [DONE]
    requests: list[bytes] = []

    async def no_done(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        requests.append(request)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + finished)
        await writer.drain()
        writer.close()

    await start_raw(no_done)
    await start_raw(no_done)
    frontend = await _started(start_frontend)
    body = {
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "Tell me"}],
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        received = await response.read()
    assert received == finished  # as the instance sent it: no error event, no continuation
    assert len(requests) == 1


@pytest.mark.parametrize("migration_limit", [1, 0])
async def test_a_stream_whose_instance_dies_after_its_done_ends_there_with_nothing_after_it(
    start_raw: StartRaw, start_frontend: StartFrontend, migration_limit: int
) -> None:
    """An instance that dies after `data: [DONE]` (before its body's last chunk) sent the
    whole stream: the client's ends there, as the instance meant, never with an error event
    after its `[DONE]` (which every client then reads as one more event), nor continued."""
    requests: list[bytes] = []

    async def dies_after_done(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        requests.append(request)
        writer.write(CHUNKED + b"%x\r\n%s\r\n" % (len(CONTINUATION), CONTINUATION))
        await writer.drain()
        writer.transport.abort()  # (no `0\r\n\r\n`: the connection is lost)

    await start_raw(dies_after_done)
    await start_raw(dies_after_done)
    frontend = await _started(start_frontend, migration_limit=migration_limit)
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        received = await response.read()  # (a chunked body ended as it should be)
    assert received == CONTINUATION
    assert len(requests) == 1
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0)
    async with client:
        stream = await client.chat.completions.create(
            model="mock-llm", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == " a time"


async def test_a_stream_framed_by_its_content_length_is_cut_short_not_spliced(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """The client was told the body's length: a continuation of another length would
    overrun it (bytes read as the next response) or leave it waiting. Such a stream is not
    migrated; it ends, as a cut-short body does, with the connection."""
    script = Script("sized")
    await start_raw(script)
    await start_raw(script)
    frontend = await _started(start_frontend)
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    assert len(script.bodies) == 1
    refused = frontend.metrics.registry.get_sample_value(
        "shoal_frontend_migrations_total", {"outcome": "refused", "reason": "framing"}
    )
    assert refused == 1


async def test_a_stream_that_sent_only_a_comment_before_failing_gets_the_continuation_whole(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """An SSE comment (a keep-alive) opens no message and names no stream: the continuation
    keeps its role chunk, its `id` and its `created` (never null ones)."""
    script = Script("ping")
    await start_raw(script)
    await start_raw(script)
    frontend = await _started(start_frontend)
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        received = await response.read()
    events = [e for e in received.split(b"\n\n") if e.startswith(b"data: ")]
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert {(c["id"], c["created"]) for c in chunks} == {("chatcmpl-second", 222)}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(script.bodies) == 2


@pytest.mark.parametrize("tail", [b"data: [DONE]\n", b"data: [DONE]"])
async def test_a_last_event_without_its_blank_line_reaches_the_client_at_a_normal_end(
    start_raw: StartRaw, start_frontend: StartFrontend, tail: bytes
) -> None:
    """The held start of an event the end cut short was dropped at a normal end (the stream
    had its finish reason): a model of one instance, which reads nothing, passes it on."""
    finished = CONTINUATION[: CONTINUATION.index(b"data: [DONE]")] + tail

    async def answer(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(CHUNKED + b"%x\r\n%s\r\n0\r\n\r\n" % (len(finished), finished))

    await start_raw(answer)
    await start_raw(answer)
    frontend = await _started(start_frontend)
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        assert await response.read() == finished


def _sse(chunk: dict[str, Any]) -> bytes:
    """One SSE event of `chunk` as a chunk of a chunked body."""
    data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


class DiesAfter:
    """An engine whose first answer sends `pieces` (one token each) and dies before its
    finish reason; later answers send `rest` as one piece, then finish and `[DONE]`."""

    def __init__(self, chat: bool, pieces: list[str], rest: str = " more") -> None:
        self.chat, self.pieces, self.rest = chat, pieces, rest
        self.bodies: list[dict[str, Any]] = []

    def _chunk(self, piece: str | None, finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta = {} if piece is None else {"content": piece}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        cid = f"cmpl-{len(self.bodies)}"
        return {"id": cid, "object": kind, "created": 100 + len(self.bodies),
                "model": "served-name", "choices": [choice]}  # fmt: skip

    async def __call__(
        self, request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.bodies.append(json.loads(request.split(b"\r\n\r\n", 1)[1]))
        out = CHUNKED
        if len(self.bodies) > 1:
            out += _sse(self._chunk(self.rest)) + _sse(self._chunk(None, "length"))
            writer.write(out + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            return
        for piece in self.pieces:
            out += _sse(self._chunk(piece))
        writer.write(out)
        await writer.drain()
        writer.transport.abort()  # (before its finish reason)


@pytest.mark.parametrize(
    ("chat", "limit", "tokens"),
    [
        (True, {"max_tokens": 3}, 3),
        (True, {"max_completion_tokens": 3}, 3),
        (False, {}, continuation.COMPLETION_DEFAULT),  # (no max_tokens: the engines' 16)
        (False, {"max_tokens": 4}, 4),
    ],
)
async def test_a_stream_whose_instance_dies_at_its_max_tokens_ends_there_not_past_it(
    start_raw: StartRaw,
    start_frontend: StartFrontend,
    chat: bool,
    limit: dict[str, int],
    tokens: int,
) -> None:
    """A stream whose instance died after its last allowed token, before its finish reason,
    was continued with `max_tokens` max(limit - tokens, 1) = 1: the client got one token past
    its limit, and a usage that said so. Now nothing is asked of another instance: the
    gateway ends the stream as the engine would have, a finish reason "length" under the
    stream's id, created and model, the usage asked for, `[DONE]`."""
    engine = DiesAfter(chat, [f" t{i}" for i in range(tokens)])
    await start_raw(engine)
    await start_raw(engine)
    frontend = await _started(start_frontend)
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="-", max_retries=0)
    options: Any = {"include_usage": True}
    async with asyncio.timeout(10):
        if chat:
            messages: Any = [{"role": "user", "content": "count"}]
            stream: Any = await client.chat.completions.create(
                model="mock-llm", messages=messages, stream=True, stream_options=options, **limit
            )
        else:
            stream = await client.completions.create(
                model="mock-llm", prompt="count", stream=True, stream_options=options, **limit
            )
        chunks = [chunk async for chunk in stream]
    await client.close()
    choices = [c.choices[0] for c in chunks if c.choices]
    pieces = [(c.delta.content if chat else c.text) for c in choices]
    assert [p for p in pieces if p] == [f" t{i}" for i in range(tokens)]
    assert choices[-1].finish_reason == "length"
    assert {(c.id, c.created, c.model) for c in chunks} == {("cmpl-1", 101, "served-name")}
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == tokens
    assert usage.total_tokens == usage.prompt_tokens + tokens
    assert len(engine.bodies) == 1  # no continuation asked for
    ended = frontend.metrics.registry.get_sample_value(
        "shoal_frontend_migrations_total", {"outcome": "ended", "reason": "lost"}
    )
    assert ended == 1


async def test_a_stream_without_usage_asked_ends_at_its_max_tokens_with_no_usage_chunk(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """The end the gateway writes has a usage chunk only when the client asked for one."""
    engine = DiesAfter(True, ["a", "b"])
    await start_raw(engine)
    await start_raw(engine)
    frontend = await _started(start_frontend)
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2, "stream": True}  # fmt: skip
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        received = await response.read()
    events = [e[len(b"data: ") :] for e in received.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert not any("usage" in c for c in chunks)


@pytest.mark.parametrize(
    ("stop", "pieces", "migrated"),
    [
        (["END"], ["The", " E"], False),  # "E" may begin "END": the rest would pass
        ("END", ["The", " EN"], False),
        (["\n\n", "END"], ["The", "\n"], False),
        (["END"], ["The", " N"], True),  # nothing of a stop string at the end
        (["END"], ["The", " EX"], True),  # ("E" found in the end, not what ends it)
    ],
)
async def test_a_stream_whose_text_ends_with_the_start_of_a_stop_string_is_not_continued(
    start_raw: StartRaw,
    start_frontend: StartFrontend,
    stop: Any,
    pieces: list[str],
    migrated: bool,
) -> None:
    """Engines look for stop strings in the text they generate, never in the text they are
    asked to continue: a stream cut after "The E" was continued with "ND more", and the
    client got the stop string "END" and text after it, which no undisturbed run sends.
    Now such a stream is not migrated (reason `stop`): it ends with the error event."""
    engine = DiesAfter(True, pieces, rest="ND more")
    await start_raw(engine)
    await start_raw(engine)
    frontend = await _started(start_frontend)
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 20, "stop": stop, "stream": True}  # fmt: skip
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        received = await response.read()
    chunks = [json.loads(e[6:]) for e in received.split(b"\n\n") if e.startswith(b"data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if "choices" in c)
    assert text == "".join(pieces) + ("ND more" if migrated else "")
    assert len(engine.bodies) == (2 if migrated else 1)
    refused = frontend.metrics.registry.get_sample_value(
        "shoal_frontend_migrations_total", {"outcome": "refused", "reason": "stop"}
    )
    assert (refused or 0) == (0 if migrated else 1)
    if not migrated:
        assert b"failed while streaming" in received
