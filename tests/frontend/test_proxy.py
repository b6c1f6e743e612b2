"""The request path against fake workers: OpenAI compatibility, errors, retries, streaming."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from shoal.frontend import Frontend
from shoal.frontend.proxy import sse
from shoal.frontend.registry.metrics import UNKNOWN_MODEL
from tests.frontend.conftest import StartFrontend, StartWorker, openai_client
from tests.frontend.raw_upstream import Behaviour, StartRaw, start_raw
from tests.frontend.support import FakeWorker, serving
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


async def ready(
    start_frontend: StartFrontend, *workers: FakeWorker, **settings: object
) -> Frontend:
    frontend = await start_frontend(**settings)
    model = workers[0].model if workers else "mock-llm"
    await wait_for(lambda: serving(frontend, model, len(workers)), message="model served")
    return frontend


async def test_chat_completion_through_the_official_client(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    client = openai_client(await ready(start_frontend, worker))
    reply = await client.chat.completions.create(model="mock-llm", messages=CHAT)
    assert reply.choices[0].message.content == f"hello from {worker.instance_id:x}"
    assert reply.model == "mock-llm"


async def test_streamed_chat_arrives_as_server_sent_events(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    worker.stream_chunks = 4
    client = openai_client(await ready(start_frontend, worker))
    stream = await client.chat.completions.create(model="mock-llm", messages=CHAT, stream=True)
    pieces = [chunk.choices[0].delta.content async for chunk in stream]
    assert pieces == [f"hello from {worker.instance_id:x}", " 1", " 2", " 3"]


async def test_streamed_bytes_reach_the_client_before_the_response_ends(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    worker.stream_chunks, worker.stream_delay = 3, 0.3
    frontend = await ready(start_frontend, worker)
    body = {"model": "mock-llm", "messages": CHAT, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        assert response.headers["Content-Type"].startswith("text/event-stream")
        first = await response.content.readline()
        assert first.startswith(b"data: ")
        assert worker.in_flight == 1  # the worker is still generating
        rest = await response.read()
    assert rest.rstrip().endswith(b"data: [DONE]")


async def test_completions_and_embeddings_are_forwarded(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    client = openai_client(await ready(start_frontend, worker))
    completion = await client.completions.create(model="mock-llm", prompt="Once upon")
    assert completion.choices[0].text == f"hello from {worker.instance_id:x}"
    stream = await client.completions.create(model="mock-llm", prompt="Once upon", stream=True)
    texts = [c.choices[0].text async for c in stream]
    assert texts[0].startswith("hello")
    embedding = await client.embeddings.create(model="mock-llm", input="hello")
    assert embedding.data[0].embedding == [0.1, 0.2, 0.3]


async def test_the_body_is_forwarded_byte_for_byte(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker)
    body = (
        '{ "messages":[{"role":"user","content":"h\\u00e9 ✓"}],  "model" : "mock-llm","x":[1.50]}'
    )
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"{frontend.url}/v1/chat/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json", "X-Custom": "kept"},
        )
        assert response.status == 200
        assert response.headers["x-shoal-instance"] == f"{worker.instance_id:x}"
    assert worker.bodies[-1] == body.encode()
    assert worker.headers[-1]["X-Custom"] == "kept"


async def test_unknown_model_is_404_in_openai_format(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker)
    with pytest.raises(openai.NotFoundError) as caught:
        await openai_client(frontend).chat.completions.create(model="nope", messages=CHAT)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "model"
    assert "nope" in error["message"]


async def test_known_model_without_ready_instance_is_503(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker)
    worker.fail_next = 10
    await worker.taint("draining")
    # The model stays known while its only instance is tainted.
    await wait_for(lambda: not frontend.registry.models["mock-llm"].serving)
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"{frontend.url}/v1/chat/completions", json={"model": "mock-llm", "messages": CHAT}
        )
        assert response.status == 503
        body = await response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "no_ready_instance"
    assert worker.requests == 0


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b'{"model": "mock-llm", "messages": [', "not valid JSON"),
        (b'{"messages": []}', "model parameter"),
        (b'{"model": 7}', "Invalid request body"),
        (b"[1, 2]", "Invalid request body"),
        (b"", "not valid JSON"),
    ],
)
async def test_malformed_body_or_missing_model_is_400(
    start_worker: StartWorker, start_frontend: StartFrontend, body: bytes, fragment: str
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker)
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{frontend.url}/v1/chat/completions", data=body)
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]
    assert worker.requests == 0


async def test_body_over_max_body_is_413(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker, max_body=1000)
    big = json.dumps({"model": "mock-llm", "messages": CHAT, "pad": "x" * 2000})
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{frontend.url}/v1/chat/completions", data=big)
        assert response.status == 413
        assert (await response.json())["error"]["code"] == "request_too_large"
        small = await session.post(
            f"{frontend.url}/v1/chat/completions", json={"model": "mock-llm", "messages": CHAT}
        )
        assert small.status == 200


async def test_api_key_is_required_when_configured(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker, api_keys=("k1", "k2"))
    with pytest.raises(openai.AuthenticationError):
        await openai_client(frontend, api_key="wrong").chat.completions.create(
            model="mock-llm",
            messages=CHAT,
        )
    with pytest.raises(openai.AuthenticationError):
        await openai_client(frontend, api_key="wrong").models.list()
    async with aiohttp.ClientSession() as session:
        missing = await session.post(
            f"{frontend.url}/v1/chat/completions", json={"model": "mock-llm", "messages": CHAT}
        )
        assert missing.status == 401
        assert (await missing.json())["error"]["code"] == "invalid_api_key"
        assert (await session.get(f"{frontend.url}/health")).status == 200
    reply = await openai_client(frontend, api_key="k2").chat.completions.create(
        model="mock-llm",
        messages=CHAT,
    )
    assert reply.choices[0].message.content
    assert "Authorization" not in worker.headers[-1]  # the gateway's key stays with it


async def test_wrong_method_and_unknown_path_are_openai_errors(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend()
    async with aiohttp.ClientSession() as session:
        wrong = await session.get(f"{frontend.url}/v1/chat/completions")
        assert wrong.status == 405
        assert "error" in await wrong.json()
        unknown = await session.post(f"{frontend.url}/v2/whatever", data=b"{}")
        assert unknown.status == 404
        assert (await unknown.json())["error"]["code"] == "unknown_url"


async def test_5xx_before_first_byte_retries_on_another_instance_and_inhibits_it(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    bad, good = await start_worker(), await start_worker()
    bad.fail_next = 100
    frontend = await ready(start_frontend, bad, good, inhibit_seconds=60)
    client = openai_client(frontend)
    for _ in range(4):
        reply = await client.chat.completions.create(model="mock-llm", messages=CHAT)
        assert reply.choices[0].message.content == f"hello from {good.instance_id:x}"
    assert bad.requests == 1  # inhibited after its first failure
    assert frontend.metrics.models["mock-llm"].retries == 1
    assert frontend.metrics.models["mock-llm"].requests == {200: 4}


async def test_connect_error_retries_on_another_instance(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    gone, good = await start_worker(), await start_worker()
    frontend = await ready(start_frontend, gone, good)
    await gone.stop()  # still registered: its lease lives on
    client = openai_client(frontend)
    for _ in range(3):
        reply = await client.chat.completions.create(model="mock-llm", messages=CHAT)
        assert reply.choices[0].message.content == f"hello from {good.instance_id:x}"


async def test_5xx_from_the_last_instance_is_passed_through(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    worker.fail_next, worker.fail_status = 1, 500
    frontend = await ready(start_frontend, worker)
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"{frontend.url}/v1/chat/completions", json={"model": "mock-llm", "messages": CHAT}
        )
        assert response.status == 500
        assert (await response.json())["error"]["message"] == "injected failure"


async def test_all_instances_refusing_gives_502_after_trying_each(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    workers = [await start_worker() for _ in range(4)]
    frontend = await ready(start_frontend, *workers, retries=1)
    for worker in workers:
        await worker.stop()
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"{frontend.url}/v1/chat/completions", json={"model": "mock-llm", "messages": CHAT}
        )
        assert response.status == 502
        assert (await response.json())["error"]["code"] == "upstream_error"
    assert frontend.metrics.models["mock-llm"].retries == 3  # refusals spent no retry


async def test_failure_after_the_first_byte_ends_the_stream_with_an_error_event(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    worker.stream_chunks, worker.die_after_chunks = 4, 2
    client = openai_client(await ready(start_frontend, worker))
    stream = await client.chat.completions.create(model="mock-llm", messages=CHAT, stream=True)
    pieces: list[str | None] = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content)
    assert len(pieces) == 2
    assert "failed while streaming" in caught.value.message


def chunk_event(text: str, newline: bytes = b"\n") -> bytes:
    data = json.dumps(
        {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "mock-llm",
         "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    )  # fmt: skip
    return b"data: " + data.encode() + newline * 2


def cut_mid_event(*packets: bytes) -> Behaviour:
    """An upstream streaming `packets` (a chunk each, written and drained one by one: the
    gateway may still read several at once, `sse.Unfinished`'s own tests split them every
    way), then dying."""

    async def answer(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for packet in packets:
            writer.write(b"%x\r\n%s\r\n" % (len(packet), packet))
            await writer.drain()
        writer.transport.abort()

    return answer


CUT = chunk_event("c")[:40]  # (`data: {"id": "c1", "object": "chat.compl`)


@pytest.mark.parametrize(
    "packets",
    [
        pytest.param(
            (chunk_event("a") + chunk_event("b") + CUT,), id="in-the-write-of-whole-events"
        ),
        pytest.param((chunk_event("a"), chunk_event("b"), CUT), id="in-a-write-of-its-own"),
        pytest.param(
            (chunk_event("a"), chunk_event("b") + CUT[:20], CUT[20:]), id="over-two-writes"
        ),
        pytest.param(
            (chunk_event("a", b"\r\n"), chunk_event("b", b"\r\n") + CUT), id="crlf-framed"
        ),
        pytest.param((chunk_event("a"), chunk_event("b")[:-1]), id="after-a-whole-line"),
    ],
)
async def test_a_stream_cut_mid_event_gives_the_official_client_its_events_then_the_error(
    start_raw: StartRaw, start_frontend: StartFrontend, packets: tuple[bytes, ...]
) -> None:
    """A stream of one instance (nothing to migrate to) whose worker died in the middle of
    an event: the gateway relayed the event's start, ended it and wrote its error event, and
    the official client raised a JSON decode error on the cut event's data, the gateway's
    error never seen. Now the start of an event is held until its end, and dropped if the
    stream breaks: the client gets every whole event, then the error naming the break."""
    await start_raw(cut_mid_event(*packets))
    client = openai_client(await ready(start_frontend))
    pieces: list[str | None] = []
    async with asyncio.timeout(10):
        stream = await client.chat.completions.create(model="mock-llm", messages=CHAT, stream=True)
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                pieces.append(chunk.choices[0].delta.content)
    assert pieces == ["a", "b"]
    assert "failed while streaming" in caught.value.message


async def test_a_stream_cut_mid_event_ends_with_whole_events_and_the_error_event(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """What the client's SSE parser reads: the whole event, then the error event, each
    whole; nothing of the event the worker left unfinished."""
    await start_raw(cut_mid_event(chunk_event("a") + CUT))
    frontend = await ready(start_frontend)
    body = {"model": "mock-llm", "messages": CHAT, "stream": True}
    url = f"{frontend.url}/v1/chat/completions"
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(url, json=body) as response,
    ):
        raw = await response.read()
    events = raw.decode().split("\n\n")
    assert len(events) == 3 and events[-1] == ""  # (two events, each ended by a blank line)
    assert events[0] == chunk_event("a").decode().strip()
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert "failed while streaming" in error["message"]


def test_the_start_of_an_event_is_held_until_its_end_whatever_the_reads() -> None:
    """`sse.Unfinished`: each read's whole events go at once; an event's start waits for its
    blank line, found across two reads too, in LF, CRLF or CR lines."""
    held = sse.Unfinished()
    assert held.take(b"data: a\n\ndata: b") == b"data: a\n\n"
    assert held.take(b"b") == b""
    assert held.take(b"\n") == b""
    assert held.take(b"\ndata: c\r\n\r\nda") == b"data: bb\n\ndata: c\r\n\r\n"
    assert held.take(b"ta: d\r\r") == b"data: d\r\r"
    assert (held.size, held.pieces) == (0, [])
    assert held.take(b"data: [DONE]") == b""
    assert held.release() == b"data: [DONE]"  # (a normal end: as it came)


def test_an_event_over_the_bound_goes_as_it_came(monkeypatch: pytest.MonkeyPatch) -> None:
    """An event over `MAX_HELD` is not held for ever: it goes as it came, in one read or
    over several (a break then ends it before the error event: the next test)."""
    monkeypatch.setattr(sse, "MAX_HELD", 16)
    held = sse.Unfinished()
    assert held.take(b"data: 0123456789") == b""
    assert held.take(b"abcdef") == b"data: 0123456789abcdef"
    assert held.take(b"\n\ndata: x\n\n") == b"\n\ndata: x\n\n"
    assert held.take(b"data: 0123456789abcdefgh") == b"data: 0123456789abcdefgh"
    assert (held.size, held.pieces) == (0, [])


async def test_an_event_over_the_bound_cut_by_a_break_is_ended_before_the_error_event(
    start_raw: StartRaw, start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sse, "MAX_HELD", 16)
    await start_raw(cut_mid_event(chunk_event("a") + CUT))
    frontend = await ready(start_frontend)
    body = {"model": "mock-llm", "messages": CHAT, "stream": True}
    url = f"{frontend.url}/v1/chat/completions"
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(url, json=body) as response,
    ):
        raw = await response.read()
    events = raw.decode().split("\n\n")
    assert events[:2] == [chunk_event("a").decode().strip(), CUT.decode()]
    assert (
        "failed while streaming" in json.loads(events[2].removeprefix("data: "))["error"]["message"]
    )


async def test_a_stream_ended_normally_in_the_middle_of_an_event_keeps_its_last_bytes(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """An upstream that ends its stream cleanly with an event not ended by a blank line
    (`data: [DONE]` alone): what was held goes to the client at the end, as it came."""
    stream = chunk_event("a") + b"data: [DONE]"

    async def answer(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(stream), stream)
        )

    await start_raw(answer)
    frontend = await ready(start_frontend)
    body = {"model": "mock-llm", "messages": CHAT, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/chat/completions", json=body) as response,
    ):
        assert await response.read() == stream


async def test_client_disconnect_cancels_the_upstream_request(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    worker.stream_chunks, worker.stream_delay = 50, 0.1
    frontend = await ready(start_frontend, worker)
    body = {"model": "mock-llm", "messages": CHAT, "stream": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{frontend.url}/v1/chat/completions", json=body)
        await response.content.readline()
        assert worker.in_flight == 1
        response.close()  # drop the connection mid-stream
    await wait_for(lambda: worker.cancelled == 1, message="the worker saw the request go")
    assert worker.in_flight == 0
    await wait_for(lambda: frontend.metrics.models["mock-llm"].in_flight == 0)
    assert frontend.metrics.models["mock-llm"].requests == {499: 1}


async def test_tainted_instance_gets_no_new_requests(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    draining, other = await start_worker(), await start_worker()
    frontend = await ready(start_frontend, draining, other)
    await draining.taint("draining")
    await wait_for(lambda: frontend.registry.models["mock-llm"].live_instances == 1)
    client = openai_client(frontend)
    for _ in range(5):
        await client.chat.completions.create(model="mock-llm", messages=CHAT)
    assert draining.requests == 0
    assert other.requests == 5


async def test_round_robin_spreads_requests_evenly(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    workers = [await start_worker() for _ in range(3)]
    client = openai_client(await ready(start_frontend, *workers))
    await asyncio.gather(
        *(client.chat.completions.create(model="mock-llm", messages=CHAT) for _ in range(30))
    )
    assert [w.requests for w in workers] == [10, 10, 10]


async def test_model_that_does_not_serve_the_route_is_400(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker("chat-only", model_types=("chat",))
    frontend = await ready(start_frontend, worker)
    with pytest.raises(openai.BadRequestError):
        await openai_client(frontend).embeddings.create(model="chat-only", input="x")
    assert worker.requests == 0


async def test_a_client_that_does_not_read_pauses_the_upstream_connection(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    worker.stream_chunks, worker.stream_padding = 600, 64 * 1024  # ~40 MB, sent at once
    frontend = await ready(start_frontend, worker)
    assert frontend.server is not None
    body = b'{"model":"mock-llm","messages":[],"stream":true}'
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s"
        % (len(body), body)
    )

    def paused_upstream() -> bool:
        return any(
            conn.writing_paused and getattr(conn.flow, "_paused", False)
            for conn in frontend.server.connections  # type: ignore[union-attr]
        )

    await wait_for(paused_upstream, message="the frontend paused reading from the worker")
    assert worker.chunks_sent < 600  # the worker is held back too, not buffered in the frontend
    received = 0
    async with asyncio.timeout(30):
        while True:
            chunk = await reader.read(1 << 20)
            received += len(chunk)
            if not chunk or chunk.endswith(b"0\r\n\r\n"):
                break
    writer.close()
    assert received > 600 * 64 * 1024
    assert worker.chunks_sent == 600


async def test_prefix_router_keeps_a_conversation_on_one_instance(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    workers = [await start_worker() for _ in range(3)]
    frontend = await ready(start_frontend, *workers, router="prefix")
    client = openai_client(frontend)
    system: ChatCompletionMessageParam = {"role": "system", "content": "You are terse. " * 40}
    history: list[ChatCompletionMessageParam] = [system]
    for turn in range(4):
        history.append({"role": "user", "content": f"question {turn}"})
        reply = await client.chat.completions.create(model="mock-llm", messages=history)
        history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    assert sorted(w.requests for w in workers) == [0, 0, 4]


async def test_an_instance_that_never_answers_is_left_after_the_first_byte_timeout(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    hung, good = await start_worker(), await start_worker()
    hung.answering.clear()  # reads the request, never sends a response head
    frontend = await ready(start_frontend, hung, good, first_byte_timeout=0.3, inhibit_seconds=60)
    client = openai_client(frontend)
    loop = asyncio.get_running_loop()
    slowest = 0.0
    for _ in range(2):  # round-robin: one of the two goes to the hung instance first
        started = loop.time()
        async with asyncio.timeout(5):
            reply = await client.chat.completions.create(model="mock-llm", messages=CHAT)
        slowest = max(slowest, loop.time() - started)
        assert reply.choices[0].message.content == f"hello from {good.instance_id:x}"
    assert hung.requests == 1
    assert 0.3 <= slowest < 3.0  # waited about the timeout, then went elsewhere
    (upstream,) = [
        u
        for ws in frontend.registry.models["mock-llm"].sets.values()
        for u in ws.routable
        if u.instance_id == hung.instance_id
    ]
    assert upstream.inhibited
    stats = frontend.metrics.models["mock-llm"]
    assert stats.retries == 1
    assert stats.requests == {200: 2}
    assert upstream.in_flight == 0 and stats.in_flight == 0


async def test_no_instance_answering_in_time_is_504_upstream_timeout(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    hung = await start_worker()
    hung.answering.clear()
    frontend = await ready(start_frontend, hung, first_byte_timeout=0.3)
    async with aiohttp.ClientSession() as session, asyncio.timeout(5):
        response = await session.post(
            f"{frontend.url}/v1/chat/completions", json={"model": "mock-llm", "messages": CHAT}
        )
        assert response.status == 504
        body = await response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "upstream_timeout"
    assert body["error"]["type"] == "server_error"
    assert "0.3s" in body["error"]["message"]
    assert hung.requests == 1
    assert frontend.metrics.models["mock-llm"].requests == {504: 1}


async def test_a_slow_instance_that_answers_within_the_timeout_is_kept(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    hung, slow = await start_worker(), await start_worker()
    hung.answering.clear()
    slow.head_delay = 0.1  # the head comes after 0.1 s ...
    slow.stream_chunks, slow.stream_delay = 4, 0.2  # ... and the stream lasts longer than 0.5 s
    frontend = await ready(start_frontend, hung, slow, first_byte_timeout=0.5, inhibit_seconds=60)
    client = openai_client(frontend)
    for _ in range(2):  # one of them meets the hung instance first: the timeout is armed
        async with asyncio.timeout(5):
            stream = await client.chat.completions.create(
                model="mock-llm", messages=CHAT, stream=True
            )
            pieces = [chunk.choices[0].delta.content async for chunk in stream]
        assert pieces == [f"hello from {slow.instance_id:x}", " 1", " 2", " 3"]
    assert (hung.requests, slow.requests) == (1, 2)
    upstreams = {
        u.instance_id: u
        for ws in frontend.registry.models["mock-llm"].sets.values()
        for u in ws.routable
    }
    assert upstreams[hung.instance_id].inhibited
    assert not upstreams[slow.instance_id].inhibited
    assert frontend.metrics.models["mock-llm"].retries == 1


async def assert_refused_too_deep(frontend: Frontend, worker: FakeWorker, body: bytes) -> None:
    """`body` is answered 400 for its nesting, in the OpenAI format, and reaches no worker."""
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{frontend.url}/v1/chat/completions", data=body)
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert "nested deeper than 64 levels" in error["message"]
    assert worker.requests == 0
    assert frontend.metrics.models[UNKNOWN_MODEL].requests == {400: 1}


@pytest.mark.parametrize("router", ["round-robin", "prefix"])
@pytest.mark.parametrize("where", ["messages", "prompt", "tools"])
async def test_a_deeply_nested_body_is_400_saying_why(
    start_worker: StartWorker, start_frontend: StartFrontend, router: str, where: str
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker, router=router)
    nested = b"[" * 100_000 + b"]" * 100_000
    body = b'{"model":"mock-llm","' + where.encode() + b'":' + nested + b"}"
    await assert_refused_too_deep(frontend, worker, body)


@pytest.mark.parametrize("depth", [65, 985, 1_000, 1_500])
async def test_a_body_nested_past_the_bound_in_a_free_form_field_is_400(
    start_worker: StartWorker, start_frontend: StartFrontend, depth: int
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker)
    nested = b'{"a":' * depth + b"1" + b"}" * depth
    body = b'{"model":"mock-llm","messages":[],"metadata":' + nested + b"}"
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{frontend.url}/v1/chat/completions", data=body)
        assert response.status == 400
        assert "nested deeper than 64 levels" in (await response.json())["error"]["message"]
    assert worker.requests == 0


@pytest.mark.parametrize("failing_pick", [1, 2])
async def test_a_failure_in_the_gateway_after_the_gauge_went_up_answers_500_and_leaves_it_at_0(
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    monkeypatch: pytest.MonkeyPatch,
    failing_pick: int,
) -> None:
    """A bug while picking an instance (the first pick, or the retry's after a 5xx, which runs
    in the upstream connection's callback) never leaves the request hanging or in flight."""
    workers = [await start_worker(), await start_worker()]
    for worker in workers:
        worker.fail_next = 1
    frontend = await ready(start_frontend, *workers)
    router = frontend.proxy.router
    choose = router.choose
    picks = 0

    def failing_choose(*args: object, **kwargs: object) -> object:
        nonlocal picks
        picks += 1
        if picks == failing_pick:
            raise RuntimeError("a bug in the router")
        return choose(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(router, "choose", failing_choose)
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"{frontend.url}/v1/chat/completions", json={"model": "mock-llm", "messages": CHAT}
        )
        assert response.status == 500
        assert (await response.json())["error"]["type"] == "server_error"
    stats = frontend.metrics.models["mock-llm"]
    assert stats.in_flight == 0
    assert stats.requests == {500: 1}
    model = frontend.registry.models["mock-llm"]
    assert all(u.in_flight == 0 for ws in model.sets.values() for u in ws.routable)
    assert sum(w.requests for w in workers) == failing_pick - 1


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "text", "text": 123}],
        [{"type": "text", "text": ["a", "b"]}],
        [{"type": "text", "text": None}, "loose string", 7],
        {"unexpected": "object"},
        12.5,
    ],
)
async def test_odd_message_content_is_forwarded_by_the_prefix_router(
    start_worker: StartWorker, start_frontend: StartFrontend, content: object
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker, router="prefix")
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": content}]}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{frontend.url}/v1/chat/completions", json=body)
        assert response.status == 200  # the worker, not the gateway, judges the content
    assert json.loads(worker.bodies[-1]) == body


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": [{"role": 5, "content": "x"}]},
        {"messages": ["not a message"]},
        {"messages": {"role": "user"}},
        {"prompt": [[1, 2], "mixed", {"x": 1}]},
        {"prompt": [None, 3.5]},
        {"input": {"text": "x"}},
    ],
)
async def test_prompt_extraction_never_fails_a_request(
    start_worker: StartWorker, start_frontend: StartFrontend, fields: dict[str, object]
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker, router="prefix")
    body = {"model": "mock-llm", **fields}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{frontend.url}/v1/completions", json=body)
        assert response.status != 500
        assert response.status == 200
    assert json.loads(worker.bodies[-1]) == body


async def test_an_instance_alone_in_its_set_is_left_once_inhibited(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    hung, good = await start_worker(), await start_worker(component="other")
    hung.answering.clear()  # one set holds only a hung instance, the other a healthy one
    frontend = await ready(start_frontend, hung, good, first_byte_timeout=0.5, inhibit_seconds=60)
    assert len(frontend.registry.models["mock-llm"].routable_sets) == 2
    client = openai_client(frontend)
    for _ in range(8):
        async with asyncio.timeout(5):
            reply = await client.chat.completions.create(model="mock-llm", messages=CHAT)
        assert reply.choices[0].message.content == f"hello from {good.instance_id:x}"
    assert hung.requests <= 1  # waited out once at most, then never picked again
    assert frontend.metrics.models["mock-llm"].retries == hung.requests


async def test_refused_connections_cost_no_retry_until_an_instance_answers(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    workers = [await start_worker() for _ in range(5)]
    frontend = await ready(start_frontend, *workers, retries=0, inhibit_seconds=60)
    for dead in workers[:4]:
        await dead.stop()  # still registered: its port now refuses connections
    client = openai_client(frontend)
    for _ in range(6):
        reply = await client.chat.completions.create(model="mock-llm", messages=CHAT)
        assert reply.choices[0].message.content == f"hello from {workers[4].instance_id:x}"
    assert frontend.metrics.models["mock-llm"].requests == {200: 6}


def test_an_upstream_failure_message_always_says_what_failed() -> None:
    from shoal.frontend.http import errors

    message = errors.upstream_failed("m", "").message
    assert not message.rstrip().endswith(":") and message.endswith("the instance failed")
