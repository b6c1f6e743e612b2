"""A request body is decoded once, whoever reads its fields, and a large one off the loop.

With API keys the frontend decoded a body for the key's model and tpm estimate, then the
proxy decoded it again for routing: a 9 MB body twice in one callback of the event loop
(41-64 ms of it under load). The fields are now decoded once, with both sets of members, and
handed from the gate to the proxy; a body of `LARGE_BODY` bytes or more is decoded in the
decoder process (`fields_later`: called from a thread), a smaller one on the loop at once (the
hot path). Counted: the decoder's calls on the body, and the decoder process' calls with it,
on the loop's thread and off it (`LoopTurns`), never timed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from shoal.discovery import FleetTarget, Route, publish_route
from shoal.discovery.grants import Grant, hash_secret
from shoal.frontend import Frontend
from shoal.frontend.http.request import Request
from shoal.frontend.http.shared import BodyBudget
from shoal.frontend.keys import gate as gate_module
from shoal.frontend.proxy import fields as fields_module
from shoal.openai import ApiError
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import FakeWorker
from tests.helpers import LoopTurns, wait_for
from tests.redis_server import RedisServer

SECRET = "sk-shoal-" + "d" * 43
LARGE = 256 << 10  # (`fields.LARGE_BODY`, as the server's `METER_FROM`)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def chat_body(size: int, model: str = "mock-llm") -> bytes:
    """A chat request of about `size` bytes (many short messages: the costly kind to decode)."""
    turn = {"role": "user", "content": "a few words of a turn"}
    per = len(json.dumps(turn)) + 1
    body = {"model": model, "messages": [turn] * max(1, size // per), "max_tokens": 3}
    return json.dumps(body).encode()


def count_decodes(body: bytes, *, elsewhere: bool = True) -> LoopTurns:
    """Every call of a decoder of `fields` on `body` (or the top-level members of it), and
    (`elsewhere`) of the decoder process with it, one unit each, on the loop's thread or off
    it."""
    turns = LoopTurns()
    for name in dir(fields_module):
        if name.startswith("_decode_") and callable(getattr(fields_module, name)):
            turns.wrap(fields_module, name, lambda data, *_, **__: int(len(data) == len(body)))
    if elsewhere:
        turns.wrap(
            fields_module.DECODER_PROCESS, "call", lambda _, data, *__: int(len(data) == len(body))
        )
    return turns


async def keyed(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    router: str,
    redis: str | None = None,
    models: tuple[str, ...] = (),
) -> tuple[Frontend, FakeWorker]:
    worker = await start_worker("mock-llm")
    grant = Grant(
        workspace="default", name="team", hash=hash_secret(SECRET), tpm=10**9, models=models
    )
    await store.put(grant.key, grant.to_json())
    front = await start_frontend(auth="keys", router=router, limits_url=redis)
    await wait_for(lambda: "mock-llm" in front.registry.models and front.keys.by_hash)  # type: ignore[union-attr]
    if redis is not None:
        await wait_for(lambda: front.limits.shared)
    return front, worker


async def post(front: Frontend, body: bytes, key: str | None = SECRET) -> int:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{front.url}/v1/chat/completions", data=body, headers=headers) as answer,
    ):
        await answer.read()
        return answer.status


@pytest.mark.parametrize("router", ["round-robin", "prefix"])
@pytest.mark.parametrize("size", [2_000, 600_000], ids=["small", "large"])
async def test_a_keyed_request_is_decoded_once_and_a_large_one_off_the_loop(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    router: str,
    size: int,
) -> None:
    front, _ = await keyed(store, start_worker, start_frontend, router)
    body = chat_body(size)
    assert (len(body) >= LARGE) is (size > LARGE)
    decodes = count_decodes(body)
    try:
        assert await post(front, body) == 200
    finally:
        await decodes.stop()
    assert decodes.on_loop + decodes.off_loop == 1, (decodes.on_loop, decodes.off_loop)
    if len(body) >= LARGE:
        assert decodes.on_loop == 0  # (in the decoder process, called from its one thread)
    else:
        assert decodes.off_loop == 0  # a small body stays on the loop's fast path


async def test_a_large_keyed_request_waiting_for_redis_is_decoded_once(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    redis_server: RedisServer,
) -> None:
    """Redis decides the key's first requests (`_Waiting`): the fields wait with them."""
    front, _ = await keyed(store, start_worker, start_frontend, "prefix", redis_server.url)
    body = chat_body(600_000)
    decodes = count_decodes(body)
    waited = LoopTurns().wrap(gate_module, "_Waiting")
    try:
        for _ in range(3):
            assert await post(front, body) == 200
    finally:
        await decodes.stop()
        await waited.stop()
    assert waited.on_loop >= 1  # (the first one at least: no allowance yet)
    assert (decodes.on_loop, decodes.off_loop) == (0, 3)


async def test_a_large_request_without_a_key_is_decoded_off_the_loop(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    await start_worker("mock-llm")
    front = await start_frontend(router="prefix")
    await wait_for(lambda: "mock-llm" in front.registry.models)
    for size in (2_000, 600_000):
        body = chat_body(size)
        decodes = count_decodes(body)
        try:
            assert await post(front, body, key=None) == 200
        finally:
            await decodes.stop()
        expected = (0, 1) if len(body) >= LARGE else (1, 0)
        assert (decodes.on_loop, decodes.off_loop) == expected, size


@pytest.mark.parametrize("router", ["round-robin", "prefix"])
@pytest.mark.parametrize("keyed_request", [True, False], ids=["key", "no-key"])
async def test_a_large_request_for_a_renamed_virtual_model_is_parsed_once_off_the_loop(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    keyed_request: bool,
    router: str,
) -> None:
    """A virtual model whose target serves it under another name: its body is sent with
    `model` rewritten, which needs its top-level members. A large body was parsed for its
    fields, then again for its members (two passes over 9 MB); now its members are parsed
    once, in the decoder, and its fields read from them; the rewrite only encodes them."""
    if keyed_request:
        front, worker = await keyed(store, start_worker, start_frontend, router)
    else:
        worker = await start_worker("mock-llm")
        front = await start_frontend(router=router)
    await publish_route(store, Route(workspace="default", name="alias", targets=(FleetTarget("mock-llm"),)))  # fmt: skip
    await wait_for(lambda: "alias" in front.routes.models and front.routes.models["alias"].serving)
    for size in (2_000, 600_000):
        body = chat_body(size, model="alias")
        decodes = count_decodes(body)
        try:
            assert await post(front, body, SECRET if keyed_request else None) == 200
        finally:
            await decodes.stop()
        if len(body) >= LARGE:
            assert (decodes.on_loop, decodes.off_loop) == (0, 1), size  # members, once
        else:
            assert (decodes.on_loop, decodes.off_loop) == (2, 0), size  # fields, members
        assert json.loads(worker.bodies[-1]) == json.loads(chat_body(size, model="mock-llm"))


@pytest.mark.parametrize("keyed_request", [True, False], ids=["key", "no-key"])
async def test_a_large_body_decoded_off_the_loop_is_refused_as_an_inline_one(
    store: Store,
    start_worker: StartWorker,
    start_frontend: StartFrontend,
    keyed_request: bool,
) -> None:
    """Not JSON: 400; nested past the bound: 400; a model nobody serves: 404; a model the
    key may not use: 403 (a key's request)."""
    key = SECRET if keyed_request else None
    if keyed_request:
        front, _ = await keyed(
            store, start_worker, start_frontend, "round-robin", models=("mock-llm",)
        )
    else:
        await start_worker("mock-llm")
        front = await start_frontend()
        await wait_for(lambda: "mock-llm" in front.registry.models)
    large = chat_body(600_000)
    assert await post(front, large[:-1], key) == 400
    deep = large[:-1] + b',"x":' + b"[" * 100 + b"]" * 100 + b"}"
    assert await post(front, deep, key) == 400
    assert await post(front, chat_body(600_000, model="nobody"), key) == (403 if key else 404)
    assert await post(front, large, key) == 200


async def test_a_client_that_leaves_while_its_body_is_decoded_is_never_answered() -> None:
    """`fields_later` is the connection's response until the fields come: cancelled (the
    client left), its decode is dropped and `done` is not called."""
    loop = asyncio.get_running_loop()
    started, release = threading.Event(), threading.Event()
    blocker = fields_module._DECODER.submit(lambda: (started.set(), release.wait(10)))
    await asyncio.to_thread(started.wait, 10)  # the decoder's thread is busy: the bodies wait

    class Client:
        def __init__(self) -> None:
            self.loop = loop
            self.current: Any = None
            self.bodies = BodyBudget(1 << 40)

        def produce_later(self, work: Any) -> None:
            self.current = work

    body = chat_body(600_000)
    request = Request(b"POST", b"/v1/chat/completions", [], body, keep_alive=True, http11=True)
    request.too_deep = False  # (judged as it came, as the server does past `METER_FROM`)
    answers: list[Any] = []
    gone, staying = Client(), Client()
    fields_module.fields_later(request, gone, answers.append)  # type: ignore[arg-type]
    fields_module.fields_later(request, staying, answers.append)  # type: ignore[arg-type]
    gone.current.cancel()  # (as `HttpConnection.connection_lost` does)
    release.set()
    await asyncio.wrap_future(blocker)
    await wait_for(lambda: answers)  # (the one left was queued after the one cancelled)
    assert gone.current.future.cancelled()
    assert len(answers) == 1 and not isinstance(answers[0], ApiError)
    assert answers[0].model == "mock-llm"


async def test_a_large_body_of_too_many_members_is_refused_only_where_it_is_rebuilt(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """A body of 1.5 million top-level members (`,"<hex>":0`) sent to a renaming alias was
    decoded as members in a thread (2-3.5 s of the interpreter lock, so of the loop), and
    with any such alias in the fleet, every large body was. Its members are now counted in
    the decoder process: past `MAX_MEMBERS` a rebuild answers 400, and a request that is not
    rebuilt (the model itself) is served as it came."""
    worker = await start_worker("mock-llm")
    front = await start_frontend()
    await publish_route(store, Route(workspace="default", name="alias", targets=(FleetTarget("mock-llm"),)))  # fmt: skip
    await wait_for(lambda: "alias" in front.routes.models and front.routes.models["alias"].serving)
    many = fields_module.MAX_MEMBERS + 1
    filler = b"".join(b',"k%06x":"%s"' % (i, b"x" * 300) for i in range(many))
    for model in (b"alias", b"mock-llm"):
        body = b'{"model":"' + model + b'","messages":[{"role":"user","content":"hi"}]' + filler
        body += b"}"
        assert len(body) >= LARGE
        decodes = count_decodes(body)
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{front.url}/v1/chat/completions", data=body) as answer,
            ):
                status, text = answer.status, await answer.text()
        finally:
            await decodes.stop()
        assert decodes.on_loop == 0, model  # (never parsed on the loop, refused or not)
        if model == b"alias":
            assert status == 400, text
            error = json.loads(text)["error"]
            assert f"{many + 2:,} top-level members" in error["message"], (
                error
            )  # (+model, messages)
            assert error["type"] == "invalid_request_error"
        else:
            assert status == 200, text
            assert worker.bodies[-1] == body  # byte for byte


async def test_a_large_body_naming_a_member_twice_is_refused_only_where_it_is_rebuilt(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """1,000 members written as 0, then again in reverse with 14 KB values: a member named
    twice keeps its first place and its last value, so the decoder process searched the body
    from its start for each (15 MB: 10-20 s, every large body of every model queued behind
    it, then a 500). Values out of the body's order are now refused where the body would be
    rebuilt (a 400 naming why), and a body not rebuilt is served as it came."""
    worker = await start_worker("mock-llm")
    front = await start_frontend()
    await publish_route(store, Route(workspace="default", name="alias", targets=(FleetTarget("mock-llm"),)))  # fmt: skip
    await wait_for(lambda: "alias" in front.routes.models and front.routes.models["alias"].serving)
    keys = range(300)
    once = b"".join(b',"k%d":0' % i for i in keys)
    again = b"".join(b',"k%d":"%d%s"' % (i, i, b"x" * 2_000) for i in reversed(keys))
    spans = LoopTurns().wrap(fields_module, "_spans")
    try:
        for model in (b"alias", b"mock-llm"):
            chat = b',"messages":[{"role":"user","content":"hi"}]'
            body = b'{"model":"' + model + b'"' + chat + once + again + b"}"
            assert len(body) >= LARGE
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{front.url}/v1/chat/completions", data=body) as answer,
            ):
                status, text = answer.status, await answer.text()
            if model == b"alias":
                assert status == 400, text
                assert "more than once" in json.loads(text)["error"]["message"], text
            else:
                assert status == 200, text
                assert worker.bodies[-1] == body  # byte for byte
    finally:
        await spans.stop()
    assert spans.on_loop == 0  # (the spans are found in the decoder process alone)
