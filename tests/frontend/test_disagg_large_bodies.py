"""A large body served in two stages is parsed once, off the event loop, and each stage's
body is encoded from its top-level members there too: its messages travel as the client
wrote them, byte for byte.

The prefill's body and the decode's were each rebuilt from the client's on the loop: its
top-level members decoded (a 10 MB prompt: tens of ms holding the loop for every other
request) and encoded again, once for the prefill and once for the decode. Counted: every
decode of a large text and every encode of large members, on the loop's thread or off it
(`LoopTurns`), never timed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest

from shoal.cards import WorkerRole
from shoal.discovery import FleetTarget, Route, publish_route
from shoal.frontend.proxy import fields as fields_module
from shoal.frontend.proxy import stages as stages_module
from shoal.store import Store
from tests.frontend.conftest import StartFrontend
from tests.frontend.raw_upstream import completion, json_answer
from tests.frontend.test_disagg_faults import _raw_stage
from tests.frontend.test_disagg_requests import HANDLE, REFUSAL, _pair, _post
from tests.helpers import LoopTurns, wait_for

LARGE = fields_module.LARGE_BODY


def messages(size: int) -> bytes:
    """A chat's `messages` of about `size` bytes, as a client may write them: escapes, a
    quote, a non-ASCII character written as itself (re-encoded, some would change)."""
    turn = b'{"role":"user","content":"caf\\u00e9 \\"na\xc3\xafve\\" words\\n"}'
    return b"[" + b",".join([turn] * (size // (len(turn) + 1))) + b"]"


def body_of(model: str, chat: bytes) -> bytes:
    return (
        b'{"model":"' + model.encode() + b'","messages":' + chat + b',"max_tokens":30,'
        b'"stream":true,"stream_options":{"include_usage":true},"min_tokens":2}'
    )


def _size(value: Any) -> int:
    if isinstance(value, dict):
        return sum(len(v) for v in value.values() if isinstance(v, msgspec.Raw | bytes | str))
    return len(value) if isinstance(value, bytes | msgspec.Raw) else 0


def count_large_work(body: bytes) -> tuple[LoopTurns, LoopTurns]:
    """(the decodes of `body` whole, on the loop or off it; every decode or encode of
    `LARGE` bytes or more, of it or a part of it)."""
    whole, large = LoopTurns(), LoopTurns()
    modules: list[Any] = [fields_module, stages_module]
    for module in modules:
        for name in dir(module):
            if name.startswith("_decode") and callable(getattr(module, name)):
                whole.wrap(module, name, lambda data, *_, **__: int(len(data) == len(body)))
                large.wrap(module, name, lambda data, *_, **__: int(len(data) >= LARGE))
        if callable(getattr(module, "_encode", None)):
            large.wrap(module, "_encode", lambda value, *_, **__: int(_size(value) >= LARGE))
    large.wrap(msgspec.json, "encode", lambda value, *_, **__: int(_size(value) >= LARGE))
    whole.wrap(  # (a call of the decoder process with the body: its decode, in that process)
        fields_module.DECODER_PROCESS, "call", lambda _, data, *__: int(len(data) == len(body))
    )
    return whole, large


@pytest.mark.parametrize("router", ["round-robin", "prefix"])
@pytest.mark.parametrize("name", ["mock-llm", "storyteller"])  # the model, an alias of it
async def test_a_large_disaggregated_request_is_parsed_once_and_rebuilt_off_the_loop(
    store: Store, start_frontend: StartFrontend, name: str, router: str
) -> None:
    frontend, prefill, (decode,) = await _pair(store, start_frontend, router=router)
    try:
        if name != "mock-llm":
            route = Route("default", name, (FleetTarget("mock-llm"),))
            await publish_route(store, route)
            await wait_for(lambda: name in frontend.routes.models, message="the alias is served")
        chat = messages(1 << 20)
        body = body_of(name, chat)
        whole, large = count_large_work(body)
        try:
            status, _, answer = await _post(frontend, body)
        finally:
            await whole.stop()
            await large.stop()
        assert status == 200, answer
        assert (whole.on_loop, whole.off_loop) == (0, 1)  # once, in the decoder
        assert large.on_loop == 0, large.per_turn  # no large decode nor encode on the loop
        assert large.off_loop >= 2  # (each stage's body encoded; decoded in the process)
        (one,) = [r.split(b"\r\n\r\n", 1)[1] for r in prefill.raw_requests]
        (two,) = [r.split(b"\r\n\r\n", 1)[1] for r in decode.raw_requests]
        assert b'"messages":' + chat in one and b'"messages":' + chat in two  # as they came
        first, second = json.loads(one), json.loads(two)
        assert first["model"] == second["model"] == "mock-llm"  # (as the workers serve it)
        assert first["max_tokens"] == 1 and first["stream"] is False
        assert "stream_options" not in first and "min_tokens" not in first
        assert first["kv_transfer_params"]["do_remote_decode"] is True
        handle = json.loads(HANDLE)["kv_transfer_params"]
        assert second["kv_transfer_params"] == handle and second["max_tokens"] == 30
        assert second["stream"] is True and second["min_tokens"] == 2
        assert second["stream_options"] == {"include_usage": True}
    finally:
        await prefill.stop()
        await decode.stop()


async def test_a_large_request_prefilled_again_is_not_parsed_again(
    store: Store, start_frontend: StartFrontend
) -> None:
    """A decode that refuses the handle makes another prefill and decode: their bodies are
    made from the members at hand, in the decoder, never from the body again."""
    answered: list[int] = []

    async def refuses_once(
        request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        answered.append(1)
        if len(answered) == 1:
            await json_answer(b"400 Bad Request", REFUSAL)(request, reader, writer)
        else:
            writer.write(completion())

    decode = await _raw_stage(store, refuses_once, WorkerRole.DECODE)
    frontend, prefill, _ = await _pair(store, start_frontend, None, 0)
    try:
        chat = messages(600_000)
        body = body_of("mock-llm", chat)
        whole, large = count_large_work(body)
        try:
            status, _, answer = await _post(frontend, body)
        finally:
            await whole.stop()
            await large.stop()
        assert status == 200, answer
        assert prefill.requests == decode.requests == 2  # (prefilled again)
        assert (whole.on_loop, whole.off_loop) == (0, 1)
        assert large.on_loop == 0, large.per_turn
        for request in prefill.raw_requests + decode.raw_requests:
            assert b'"messages":' + chat in request
    finally:
        await prefill.stop()
        await decode.stop()
