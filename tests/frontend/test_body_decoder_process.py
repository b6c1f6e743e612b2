"""A large request body is decoded in a process of the frontend's own, so the event loop keeps
turning while it is.

A thread of this process decoded it before: msgspec holds the interpreter lock for a whole
decode, so the loop (every other request and stream) waited as if the decode ran on it, the
longer the larger the body (20 MB of chat: tens of milliseconds). Counted here: how often a
1 ms callback gets to run while a 20 MB body is decoded; the fields handed back, compared
with those decoded here; the decoder process killed, and stopped with the frontend.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import aiohttp
import msgspec
import pytest

from shoal.frontend.http.request import Request
from shoal.frontend.http.shared import BodyBudget
from shoal.frontend.proxy import fields as fields_module
from shoal.frontend.proxy.decoder_process import DecoderFailed
from shoal.frontend.proxy.fields import ABSENT, NO_KV_TRANSFER_PARAMS, Fields, decode_fields
from shoal.openai import ApiError
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.test_body_decoded_once import chat_body, count_decodes
from tests.frontend.test_large_bodies_edges import ODD
from tests.frontend.test_proxy import ready
from tests.helpers import LoopTurns, wait_for

TURNS_WHILE_DECODED = 10
"""Runs of a 1 ms callback the loop must give while a 20 MB chat is decoded (a decode in a
thread of this process gave 0-3: the loop stood still until it was done)."""


class Client:
    """The connection a response produced later sees (`fields_later` needs only these)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.current: Any = None
        self.bodies = BodyBudget(1 << 40)

    def produce_later(self, work: Any) -> None:
        self.current = work


class Probe:
    """A callback that asks to run every millisecond; `runs` counts how often it did."""

    def __init__(self) -> None:
        self.runs = 0
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(0.001, self._tick)

    def _tick(self) -> None:
        self.runs += 1
        self._handle = self._loop.call_later(0.001, self._tick)

    def stop(self) -> None:
        self._handle.cancel()


async def decoded(
    body: bytes,
    *,
    with_prompt: bool = True,
    with_tokens: bool = False,
    probe: Probe | None = None,
) -> tuple[Fields | ApiError, int]:
    """`fields_later` of `body` (judged not too deep, as the server judges a large body as
    it comes), and the probe's runs when the answer came."""
    request = Request(b"POST", b"/v1/chat/completions", [], body, keep_alive=True, http11=True)
    request.too_deep = False
    answer: asyncio.Future[tuple[Fields | ApiError, int]] = (
        asyncio.get_running_loop().create_future()
    )

    def done(fields: Fields | ApiError) -> None:
        answer.set_result((fields, probe.runs if probe is not None else 0))

    fields_module.fields_later(
        request,
        Client(),  # type: ignore[arg-type]
        done,
        with_prompt=with_prompt,
        with_tokens=with_tokens,
    )
    return await asyncio.wait_for(answer, 60)


def plain(fields: Fields | ApiError) -> Any:
    """Fields as comparable values: each `msgspec.Raw` as its bytes."""
    if isinstance(fields, ApiError):
        return ("refused", fields.status, fields.message, fields.param)
    values: dict[str, Any] = {"class": type(fields).__name__}
    for name in fields.__struct_fields__:
        value = getattr(fields, name)
        if isinstance(value, msgspec.Raw):
            value = bytes(value)
        elif name == "messages" and value is not None:
            value = [bytes(m) if isinstance(m, msgspec.Raw) else m for m in value]
        values[name] = value
    return values


def inline(body: bytes, *, with_prompt: bool, with_tokens: bool) -> Any:
    try:
        fields = decode_fields(
            body, with_prompt=with_prompt, too_deep=False, with_tokens=with_tokens
        )
    except ApiError as exc:
        return plain(exc)
    return plain(fields)


async def test_the_event_loop_keeps_turning_while_a_20_mb_body_is_decoded() -> None:
    await decoded(chat_body(300_000))  # (the decoder's start, once, is not what is judged)
    body = chat_body(20_000_000)  # ~425,000 short messages: the costly kind to decode
    decodes = count_decodes(body, elsewhere=False)
    probe = Probe()
    try:
        start = probe.runs
        fields, runs = await decoded(body, with_prompt=True, with_tokens=True, probe=probe)
    finally:
        probe.stop()
        await decodes.stop()
    assert runs - start >= TURNS_WHILE_DECODED, f"the 1 ms callback ran {runs - start} times"
    assert (decodes.on_loop, decodes.off_loop) == (0, 0)  # (none in this process)
    assert isinstance(fields, fields_module.LargePromptTokenFields)
    assert fields.model == "mock-llm" and bytes(fields.max_tokens) == b"3"
    assert fields.messages is not None and len(fields.messages) == len(json.loads(body)["messages"])
    assert bytes(fields.messages[-1]) == b'{"role": "user", "content": "a few words of a turn"}'


BODIES = {
    "chat": chat_body(600_000),
    "odd messages": json.dumps(
        {"model": "m", "stream": True, "max_completion_tokens": 7, "messages": [*ODD, *ODD]}
    ).encode(),
    "messages not a list": json.dumps({"model": "m", "messages": "x" * 300_000}).encode(),
    "null messages": json.dumps({"model": "m", "messages": None, "pad": "y" * 300_000}).encode(),
    "empty messages": json.dumps({"model": "m", "messages": [], "pad": "y" * 300_000}).encode(),
    "completion": json.dumps(
        {"model": "m", "max_tokens": "12", "prompt": ["p" * 300_000]}
    ).encode(),
    "token ids": json.dumps({"model": "m", "prompt": list(range(60_000))}).encode(),
    "embedding": json.dumps({"model": "m", "input": ["in", "z" * 300_000]}).encode(),
    "kv transfer params": json.dumps(
        {"model": "m", "kv_transfer_params": {"a": [1, 2]}, "messages": [{"c": "w" * 300_000}]}
    ).encode(),
    "spaced": b'{ "model" : "m" ,\n "messages" : [ {"a": 1} ,\t"s" , 2 , "'
    + b"q" * 300_000
    + b'" ] , "max_tokens" : 4 }',
    "duplicate members": b'{"model":"a","max_tokens":1,"model":"b","max_tokens":2,"pad":"'
    + b"p" * 300_000
    + b'"}',
    "no model": json.dumps({"messages": [{"role": "user", "content": "x" * 300_000}]}).encode(),
    "stream not a bool": json.dumps({"model": "m", "stream": "x" * 300_000}).encode(),
    "not json": b'{"model":"m","messages":["' + b"x" * 300_000,
    "not an object": json.dumps(["m"] * 100_000).encode(),
}


@pytest.mark.parametrize("with_tokens", [False, True], ids=["fields", "with-tokens"])
@pytest.mark.parametrize("with_prompt", [False, True], ids=["no-prompt", "prompt"])
@pytest.mark.parametrize("name", list(BODIES))
async def test_a_large_bodys_fields_are_those_decoded_here(
    name: str, with_prompt: bool, with_tokens: bool
) -> None:
    body = BODIES[name]
    assert len(body) >= fields_module.LARGE_BODY
    fields, _ = await decoded(body, with_prompt=with_prompt, with_tokens=with_tokens)
    expected = inline(body, with_prompt=with_prompt, with_tokens=with_tokens)
    assert plain(fields) == expected
    if not isinstance(fields, ApiError):
        # (what is absent is the very object the code compares with)
        if b"kv_transfer_params" not in body:
            assert fields.kv_transfer_params is NO_KV_TRANSFER_PARAMS
        if with_tokens and b"max_tokens" not in body:
            assert getattr(fields, "max_tokens") is ABSENT  # noqa: B009


async def test_a_huge_prompt_is_handed_over_cut_to_what_routing_reads() -> None:
    text = "word " * 700_000  # 3.5 M characters
    ids = list(range(200_000))
    for prompt, cut in (
        (text, text[: fields_module.PROMPT_CUT_CHARS]),
        (ids, ids[: fields_module.PROMPT_CUT_ITEMS]),
    ):
        body = json.dumps({"model": "m", "prompt": prompt}).encode()
        fields, _ = await decoded(body)
        here = decode_fields(body, with_prompt=True, too_deep=False)
        assert isinstance(fields, fields_module.LargePromptFields)
        assert fields.prompt == cut != prompt
        assert fields_module.prompt_text(fields) == fields_module.prompt_text(here) != ""


async def test_a_large_bodys_members_are_those_decoded_here() -> None:
    body = BODIES["duplicate members"]
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    fields_module.members_later(body, Client(), answer.set_result)  # type: ignore[arg-type]
    members = await asyncio.wait_for(answer, 60)
    here = fields_module._decode_members(body)
    assert {k: bytes(v) for k, v in members.items()} == {k: bytes(v) for k, v in here.items()}
    assert list(members) == list(here)
    assert fields_module.rewrite_model(body, "c", members) == fields_module.rewrite_model(body, "c")


def gone(pid: int) -> bool:
    """Whether process `pid`, a child of this one, has ended and been reaped."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


async def test_a_killed_decoder_process_is_replaced_and_the_request_answered() -> None:
    body = chat_body(300_000)
    expected = inline(body, with_prompt=True, with_tokens=False)
    fields, _ = await decoded(body)
    assert plain(fields) == expected
    first = fields_module.DECODER_PROCESS.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    fields, _ = await decoded(body)  # (its call finds the process dead: a new one answers)
    assert plain(fields) == expected
    second = fields_module.DECODER_PROCESS.pid
    assert second not in (None, first)
    assert gone(first)
    # killed while it reads or decodes a large body: that body is answered, by the next one
    request = asyncio.ensure_future(decoded(chat_body(20_000_000)))
    await asyncio.sleep(0)  # (the call is made: the thread sends the body)
    os.kill(second, signal.SIGKILL)
    fields, _ = await request
    assert isinstance(fields, fields_module.LargePromptFields) and fields.model == "mock-llm"
    assert fields_module.DECODER_PROCESS.pid not in (None, first, second)
    assert gone(second)


def die(body: bytes) -> None:
    """A decode that kills its process (run there)."""
    os.kill(os.getpid(), signal.SIGKILL)


async def test_a_body_the_decoder_dies_of_twice_is_answered_500_not_hung() -> None:
    loop = asyncio.get_running_loop()
    call = fields_module.DECODER_PROCESS.call
    with pytest.raises(DecoderFailed):
        await loop.run_in_executor(fields_module._DECODER, call, die, b"{}")
    answers: list[Any] = []
    fields_module.InThread(Client(), lambda: call(die, b"{}"), answers.append)  # type: ignore[arg-type]
    await wait_for(lambda: answers, timeout=60)
    assert isinstance(answers[0], ApiError) and answers[0].status == 500
    fields, _ = await decoded(chat_body(300_000))  # (and the next body is decoded)
    assert isinstance(fields, fields_module.LargePromptFields)


async def test_a_large_body_that_came_in_pieces_is_joined_off_the_loop_and_forwarded_whole(
    start_worker: StartWorker, start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server hands a large body over as the pieces it came in (`BodyPieces.whole`), and
    the decoder's thread joins them when it reads the body first: `bytes.join` lets go of the
    GIL for its copy there, where 20-30 MB held the loop 4-50 ms (the copy, and the faults of
    its fresh pages)."""
    worker = await start_worker(max_body=64 << 20)
    front = await ready(start_frontend, worker, router="prefix", max_body=64 << 20)
    body = chat_body(20_000_000)
    joins = LoopTurns()
    read = Request.body.fget
    assert read is not None

    def joining(request: Request) -> bytes:
        if request._body is None:
            joins.note()
        return read(request)

    monkeypatch.setattr(Request, "body", property(joining))
    async with aiohttp.ClientSession() as session:
        answer = await session.post(f"{front.url}/v1/chat/completions", data=body)
        assert answer.status == 200, await answer.text()
    assert (joins.on_loop, joins.off_loop) == (0, 1)
    assert worker.bodies == [body]


async def test_the_decoder_process_ends_with_the_frontend(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker(max_body=64 << 20)
    front = await ready(start_frontend, worker, router="prefix", max_body=64 << 20)
    body = chat_body(20_000_000)
    async with aiohttp.ClientSession() as session:
        answer = await session.post(f"{front.url}/v1/chat/completions", data=body)
        assert answer.status == 200, await answer.text()
    assert worker.bodies == [body]  # (forwarded byte for byte)
    pid = fields_module.DECODER_PROCESS.pid
    assert pid is not None
    await front.stop()
    assert fields_module.DECODER_PROCESS.pid is None
    await wait_for(lambda: gone(pid), message="the decoder process ends with its frontend")
