"""The usage event a key's stream asks its engine for stays hidden from its client whatever
the framing: a raw engine (its bytes exactly as written), a frontend with `--auth keys`, and
real clients (raw sockets, the official `openai` package).

What was wrong (review of the fix-stream-usage merge): the event was taken out of the
proxy's chunked writes only, and only as its `data:` line ending in LF. An HTTP/1.0 client
(nginx's default `proxy_http_version`) gets no chunked framing: it saw the usage event it
never asked for. An engine writing CRLF line ends (SSE allows them) had the event pass as it
came; one whose events carry other fields (`id:`, `event:`) had its `data:` line removed
alone, the fields left as an event without data, on which the official client fails
(`json.loads("")`)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, openai_client
from tests.frontend.raw_upstream import StartRaw, start_raw
from tests.frontend.support import raw_exchange, serving
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture

SECRET = "sk-shoal-" + "f" * 43
USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}


def _chunk(**members: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "mock-llm",
            **members}  # fmt: skip


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()  # (as engines write it)


def _events(newline: bytes, fields: bytes = b"", after: bytes = b"", usage: bool = True) -> bytes:
    """A chat stream as an engine writes it: two chunks of text, the usage event if asked
    (`choices` empty), `[DONE]`; each line ended by `newline`, each event with `fields` (an
    `id:` line, say; `#` is the event's number) before its data, and `after` it."""
    texts = [_chunk(choices=[{"index": 0, "delta": {"content": word}, "finish_reason": None}])
             for word in ("Hello", " there")]  # fmt: skip
    payloads = [_encode(t) for t in texts]
    if usage:
        payloads.append(_encode(_chunk(choices=[], usage=USAGE)))
    payloads.append(b"[DONE]")
    out = b""
    for number, payload in enumerate(payloads):
        before, later = (f.replace(b"#", b"%d" % number).replace(b"\n", newline)
                         for f in (fields, after))  # fmt: skip
        out += before + b"data: " + payload + newline + later + newline
    return out


def _engine(newline: bytes, fields: bytes = b"", after: bytes = b"") -> Any:
    """A raw engine answering `_events`, the usage event when the request asks for it."""

    async def answer(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        options = json.loads(request.partition(b"\r\n\r\n")[2]).get("stream_options")
        asked = bool(options and options.get("include_usage"))
        body = _events(newline, fields, after, asked)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        await writer.drain()

    return answer


async def _keyed_frontend(store: Store, start_frontend: StartFrontend) -> Frontend:
    grant = Grant(workspace="default", name="team", hash=hash_secret(SECRET))
    await store.put(grant.key, grant.to_json())
    front = await start_frontend(auth="keys")
    await wait_for(lambda: serving(front) and bool(front.keys and front.keys.by_hash))
    return front


BODY = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_an_http10_clients_keyed_stream_never_sees_the_usage_it_did_not_ask_for(
    store: Store, start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    await start_raw(_engine(b"\n"))
    front = await _keyed_frontend(store, start_frontend)
    body = json.dumps(BODY).encode()
    head = (b"POST /v1/chat/completions HTTP/1.0\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n"
            % (SECRET.encode(), len(body)))  # fmt: skip
    answer = await raw_exchange(front.port, head + body)
    status, _, received = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200") and b"chunked" not in status.lower()
    assert received.endswith(b"data: [DONE]\n\n") and b"Hello" in received
    assert received == _events(b"\n", usage=False)  # (the engine asked for none)


@pytest.mark.parametrize(
    ("newline", "fields", "after"),
    [
        (b"\r\n", b"", b""),
        (b"\n", b"id: #\n", b""),
        (b"\n", b"", b"id: #\n"),
        (b"\r\n", b"event: message\n: a comment\n", b"id: #\n"),
    ],
    ids=["crlf", "id-before", "id-after", "crlf-fields-comment"],
)
async def test_the_usage_event_is_hidden_whole_whatever_its_line_ends_and_fields(
    store: Store, start_raw: StartRaw, start_frontend: StartFrontend, newline: bytes,
    fields: bytes, after: bytes,
) -> None:  # fmt: skip
    await start_raw(_engine(newline, fields, after))
    front = await _keyed_frontend(store, start_frontend)
    async with openai_client(front, api_key=SECRET) as client:
        stream = await client.chat.completions.create(
            model="mock-llm", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = [chunk async for chunk in stream]  # (an event without data: JSONDecodeError)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "Hello there"
        assert [c for c in chunks if c.usage is not None or not c.choices] == []
        asked = await client.chat.completions.create(
            model="mock-llm", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        usages = [c.usage.completion_tokens async for c in asked if c.usage is not None]
        assert usages == [USAGE["completion_tokens"]]  # the client's own: as the engine sent


async def test_a_keyed_stream_is_only_ever_whole_events_to_the_client(
    store: Store, start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """The stream as a raw HTTP/1.1 client reads it: every event the engine sent but the
    usage, byte for byte, nothing left of the usage event."""
    await start_raw(_engine(b"\n", b"id: #\n"))
    front = await _keyed_frontend(store, start_frontend)
    body = json.dumps(BODY).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (SECRET.encode(), len(body)))  # fmt: skip
    answer = await raw_exchange(front.port, head + body)
    _, _, chunked = answer.partition(b"\r\n\r\n")
    received = b""
    while (size := int(chunked[: chunked.index(b"\r\n")], 16)) > 0:
        start = chunked.index(b"\r\n") + 2
        received += chunked[start : start + size]
        chunked = chunked[start + size + 2 :]
    events = _events(b"\n", b"id: #\n").split(b"\n\n")
    assert received == b"\n\n".join(events[:2] + events[3:])  # (the usage event's out)
