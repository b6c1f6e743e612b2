"""What a request to a model served in two stages is sent, and what its client gets back:
each kind goes where it is computed once, the prefill's answer is read as it is, a decode's
refusal of the handle is never the client's error, and the stage's own ids stay inside."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from shoal.cards import WorkerRole
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import RawUpstream, completion, json_answer
from tests.frontend.test_disagg_faults import _raw_stage, _two_stages
from tests.helpers import wait_for

CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
HANDLE = b'{"id":"p","choices":[],"kv_transfer_params":{"remote_block_ids":[1]}}'
REFUSAL = (
    b'{"error":{"message":"blocks gone","type":"BadRequestError",'
    b'"param":"kv_transfer_params","code":400}}'
)
EMBEDDING = b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5]}]}'
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _event(delta: dict[str, str], finish: str | None = None) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "mock-llm",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
    data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _answers(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(completion())


async def _pair(
    store: Store, start_frontend: StartFrontend, prefill: RawUpstream | None = None,
    decodes: int = 1, **settings: object,
) -> tuple[Frontend, RawUpstream, list[RawUpstream]]:  # fmt: skip
    prefill = prefill or await _raw_stage(store, json_answer(b"200 OK", HANDLE), WorkerRole.PREFILL)
    made = [await _raw_stage(store, _answers, WorkerRole.DECODE) for _ in range(decodes)]
    frontend = await start_frontend(**settings)
    await _two_stages(frontend)

    def all_decodes() -> bool:
        stages = frontend.registry.models["mock-llm"].stages
        return stages is not None and stages.decode.live_instances >= max(decodes, 1)

    await wait_for(all_decodes, message="every decode instance serves")
    return frontend, prefill, made


async def _post(
    frontend: Frontend, body: object, path: str = "chat/completions", **headers: str
) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession(auto_decompress=False) as session,
        asyncio.timeout(10),
        session.post(f"{frontend.url}/v1/{path}", data=body if isinstance(body, bytes) else
                     json.dumps(body), headers=headers) as response,
    ):  # fmt: skip
        return response.status, dict(response.headers), await response.read()


async def test_an_embeddings_request_is_computed_once_on_a_prefill_instance(
    store: Store, start_frontend: StartFrontend
) -> None:
    prefill = await _raw_stage(store, json_answer(b"200 OK", EMBEDDING), WorkerRole.PREFILL)
    frontend, _, (decode,) = await _pair(store, start_frontend, prefill)
    try:
        body = {"model": "mock-llm", "input": "hi"}
        status, _, answer = await _post(frontend, body, "embeddings")
        assert status == 200 and answer == EMBEDDING
        (sent,) = prefill.raw_requests  # whole: not stage one of a decode
        assert sent.endswith(json.dumps(body).encode()) and b"kv_transfer_params" not in sent
        assert decode.requests == 0  # (it was computed a second time there)
    finally:
        await prefill.stop()
        await decode.stop()


async def test_a_handle_refused_on_the_last_attempt_is_a_502_not_the_decodes_400(
    store: Store, start_frontend: StartFrontend
) -> None:
    """The client never sent `kv_transfer_params`: a 400 naming it is not its error to fix."""
    decode = await _raw_stage(store, json_answer(b"400 Bad Request", REFUSAL), WorkerRole.DECODE)
    frontend, prefill, _ = await _pair(store, start_frontend, None, 0, retries=1)
    try:
        status, _, answer = await _post(frontend, CHAT)
        assert status == 502, answer
        error = json.loads(answer)["error"]
        assert error["code"] == "upstream_error" and "could not fetch" in error["message"]
        assert decode.requests == 2 and prefill.requests == 2
    finally:
        await prefill.stop()
        await decode.stop()


async def test_a_stream_whose_first_decode_refused_the_handle_still_migrates(
    store: Store, start_frontend: StartFrontend
) -> None:
    calls: list[int] = []

    async def decode(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        calls.append(1)
        if len(calls) == 1:  # cannot fetch the blocks
            await json_answer(b"400 Bad Request", REFUSAL)(request, reader, writer)
        elif len(calls) == 2:  # streams, then dies
            writer.write(SSE_HEAD + _event({"role": "assistant", "content": ""}) +
                         _event({"content": "Hello"}))  # fmt: skip
            await writer.drain()
            writer.transport.abort()
        else:  # the continuation
            writer.write(SSE_HEAD + _event({"role": "assistant", "content": " world"}) +
                         _event({}, "stop") + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")  # fmt: skip

    decodes = [await _raw_stage(store, decode, WorkerRole.DECODE) for _ in range(3)]
    frontend, prefill, _ = await _pair(store, start_frontend, None, 0)
    try:
        await wait_for(lambda: _decodes(frontend) == 3, message="3 decode instances")
        status, _, answer = await _post(frontend, {**CHAT, "stream": True})
        assert status == 200
        assert b"data: [DONE]" in answer and b"error" not in answer, answer
        assert b"Hello" in answer and b" world" in answer
    finally:
        await prefill.stop()
        for upstream in decodes:
            await upstream.stop()


def _decodes(frontend: Frontend) -> int:
    stages = frontend.registry.models["mock-llm"].stages
    return 0 if stages is None else stages.decode.live_instances


async def test_the_prefill_is_asked_for_its_answer_uncompressed_whatever_the_client_accepts(
    store: Store, start_frontend: StartFrontend
) -> None:
    """Its answer is read here for the handle (a compressed one was "no usable JSON": the
    prefill inhibited, the client a 502); the decode's too, as every forwarded request (a key's
    usage is read from the answer)."""
    frontend, prefill, (decode,) = await _pair(store, start_frontend)
    try:
        status, _, _ = await _post(frontend, CHAT, **{"Accept-Encoding": "gzip"})
        assert status == 200
        (sent,) = prefill.raw_requests
        head = sent.split(b"\r\n\r\n")[0].lower()
        assert b"accept-encoding: identity" in head and b"gzip" not in head
        decoded = decode.raw_requests[0].split(b"\r\n\r\n")[0].lower()
        assert b"accept-encoding: identity" in decoded and b"gzip" not in decoded
    finally:
        await prefill.stop()
        await decode.stop()


async def test_a_member_name_that_is_not_utf8_is_a_400_before_any_stage(
    store: Store, start_frontend: StartFrontend
) -> None:
    frontend, prefill, (decode,) = await _pair(store, start_frontend)
    try:
        body = json.dumps(CHAT).encode()[:-1] + b', "\xff\xfe": 1}'
        status, _, answer = await _post(frontend, body)
        assert status == 400, answer
        assert "not valid JSON" in json.loads(answer)["error"]["message"]
        assert prefill.requests == 0 and decode.requests == 0
    finally:
        await prefill.stop()
        await decode.stop()


async def test_the_stage_request_id_an_engine_echoes_is_never_the_clients(
    store: Store, start_frontend: StartFrontend
) -> None:
    async def echoes(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        head = request.split(b"\r\n\r\n")[0].split(b"\r\n")
        given = [
            line.split(b":", 1)[1].strip()
            for line in head
            if line.lower().startswith(b"x-request-id:")
        ]
        writer.write(completion(extra_headers=b"x-request-id: %s\r\n" % given[0]))

    decode = await _raw_stage(store, echoes, WorkerRole.DECODE)
    frontend, prefill, _ = await _pair(store, start_frontend, None, 0)
    try:
        status, headers, _ = await _post(frontend, CHAT)
        assert status == 200 and b"shoal-" in decode.raw_requests[0]  # (the stage's id)
        assert "x-request-id" not in {k.lower() for k in headers}
        status, headers, _ = await _post(frontend, CHAT, **{"X-Request-Id": "mine"})
        assert (
            status == 200 and {k.lower(): v for k, v in headers.items()}["x-request-id"] == "mine"
        )
    finally:
        await prefill.stop()
        await decode.stop()
