"""The mocker's prefill and decode roles: vLLM's NixlConnector handoff, over a side channel."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from shoal.cards import WorkerRole
from shoal.worker.engines.mocker import MockerEngine
from tests.helpers import wait_for
from tests.worker.engines.test_mocker import MODEL, Make, chat

STAGE_ONE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
PROMPT = "the quick brown fox jumps over the lazy dog " * 20


@pytest.fixture
async def make_mocker() -> AsyncIterator[Make]:
    made: list[tuple[MockerEngine, TestClient[Any, Any]]] = []

    async def make(**kwargs: Any) -> tuple[MockerEngine, TestClient[Any, Any]]:
        engine = MockerEngine(MODEL, **kwargs)
        await engine.start()
        client: TestClient[Any, Any] = TestClient(
            TestServer(engine.app(), handler_cancellation=True)
        )
        await client.start_server()
        made.append((engine, client))
        return engine, client

    yield make
    for engine, client in made:
        await client.close()
        await engine.stop()


async def prefill(client: TestClient[Any, Any], **extra: Any) -> dict[str, Any]:
    body = chat(PROMPT, max_tokens=1, stream=False, kv_transfer_params=STAGE_ONE, **extra)
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    answer: dict[str, Any] = await resp.json()
    return answer


async def test_a_prefill_names_itself_and_its_blocks_and_the_decode_computes_no_prefill(
    make_mocker: Make,
) -> None:
    p_engine, p_client = await make_mocker(role="prefill", speedup=10)
    d_engine, d_client = await make_mocker(role="decode", speedup=10)
    answer = await prefill(p_client)
    params = answer["kv_transfer_params"]
    assert params["remote_engine_id"] == p_engine.held.engine_id
    assert (params["remote_host"], params["remote_port"]) == (
        "127.0.0.1",
        p_engine.side_channel and p_engine.side_channel.port,
    )
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"]) == -(-prompt_tokens // 16)
    assert p_engine.computed_prompt_tokens == prompt_tokens

    resp = await d_client.post(
        "/v1/chat/completions", json=chat(PROMPT, max_tokens=5, kv_transfer_params=params)
    )
    assert resp.status == 200, await resp.text()
    decoded = await resp.json()
    assert decoded["usage"]["prompt_tokens"] == prompt_tokens
    assert decoded["usage"]["completion_tokens"] == 5
    assert d_engine.computed_prompt_tokens == 0  # every prompt token came over
    assert d_engine.remote_decodes == 1 and p_engine.remote_prefills == 1
    assert (
        d_engine.kv_received_blocks
        == p_engine.held.served_blocks
        == len(params["remote_block_ids"])
    )
    # Fetched once: the same params again point at blocks no longer held.
    resp = await d_client.post(
        "/v1/chat/completions", json=chat(PROMPT, max_tokens=5, kv_transfer_params=params)
    )
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "kv_transfer_params.remote_block_ids"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"remote_port": 1}, "kv_transfer_params.remote_host"),  # nothing listens there
        ({"remote_engine_id": "someone-else"}, "kv_transfer_params.remote_engine_id"),
        ({"remote_block_ids": [10**9]}, "kv_transfer_params.remote_block_ids"),
        ({"remote_port": "x"}, "kv_transfer_params.remote_port"),
    ],
)
async def test_a_decode_refuses_params_that_point_nowhere_naming_the_field(
    make_mocker: Make, change: dict[str, Any], field: str
) -> None:
    _, p_client = await make_mocker(role="prefill", speedup=0)
    d_engine, d_client = await make_mocker(role="decode", speedup=0)
    params = (await prefill(p_client))["kv_transfer_params"] | change
    resp = await d_client.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "kv_transfer_params": params}
    )
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == field and error["code"] == "kv_transfer_failed"
    assert d_engine.requests["completions"] == 0


async def test_the_transfer_takes_the_time_per_block(make_mocker: Make) -> None:
    _, p_client = await make_mocker(role="prefill", speedup=0)
    d_engine, d_client = await make_mocker(
        role="decode", speedup=1, kv_transfer_us_per_block=20_000
    )
    params = (await prefill(p_client))["kv_transfer_params"]
    blocks = len(params["remote_block_ids"])
    started = time.perf_counter()
    resp = await d_client.post(
        "/v1/chat/completions",
        json=chat(PROMPT, max_tokens=1, kv_transfer_params=params),
    )
    assert resp.status == 200
    assert time.perf_counter() - started >= blocks * 0.02
    assert d_engine.kv_fetch_seconds >= blocks * 0.02  # the handoff wait, on /metrics


async def test_only_a_prefill_mocker_hands_off_and_only_whole_answers(make_mocker: Make) -> None:
    engine, client = await make_mocker(role=WorkerRole.DECODE, speedup=0)
    body = chat(PROMPT, max_tokens=1, kv_transfer_params=STAGE_ONE)
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "kv_transfer_params.do_remote_decode"
    _, p_client = await make_mocker(role="prefill", speedup=0)
    resp = await p_client.post("/v1/chat/completions", json=body | {"stream": True})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "stream"
    served = await engine.served_models()
    assert served[0].role is WorkerRole.DECODE


async def stream_gaps(client: TestClient[Any, Any], body: dict[str, Any]) -> list[float]:
    """The gaps between the chunks of a streamed answer, in seconds."""
    gaps: list[float] = []
    async with client.post("/v1/chat/completions", json=body | {"stream": True}) as resp:
        last = None
        async for _ in resp.content:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


@pytest.mark.parametrize("stalls", [True, False])
async def test_a_prefill_stalls_the_decode_steps_of_an_aggregated_worker_only_when_asked(
    make_mocker: Make, stalls: bool
) -> None:
    engine, client = await make_mocker(
        prefill_us_per_token=1000, itl_ms=5, prefill_stalls_decode=stalls
    )
    decoding = asyncio.create_task(stream_gaps(client, chat("hi", max_tokens=60)))
    await wait_for(lambda: engine.generation_tokens >= 3, message="the first sequence decodes")
    long_prompt = chat(" ".join(f"w{i}" for i in range(300)), max_tokens=1)
    resp = await client.post("/v1/chat/completions", json=long_prompt)
    assert resp.status == 200
    worst = max(await decoding)
    if stalls:
        assert worst >= 0.2  # the other sequence's ~300 ms prefill held it
    else:
        assert worst < 0.2


async def test_a_flood_of_prefills_never_fetched_holds_only_unexpired_blocks(
    make_mocker: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks no decode fetches are dropped when they expire, even when no decode ever
    fetches anything (expiry ran only on a fetch: a prefill-only flood kept every block
    up to a million)."""
    from shoal.worker.engines.mocker import kv_transfer

    monkeypatch.setattr(kv_transfer, "HOLD_SECONDS", 0.0)  # every hold expires at once
    engine, client = await make_mocker(role=WorkerRole.PREFILL, speedup=0)
    blocks = len((await prefill(client))["kv_transfer_params"]["remote_block_ids"])
    for _ in range(20):
        await prefill(client)
    assert engine.held.count <= blocks


async def test_a_fetch_naming_a_block_twice_is_refused_and_takes_nothing(
    make_mocker: Make,
) -> None:
    """A fetch of [id, id] passed the "all held" check, the second pop raised KeyError: the
    side channel's handler died without an answer and the first block was released unserved.
    Now it is answered with an error naming the field, nothing is taken, and the blocks are
    still there for the right fetch."""
    p_engine, p_client = await make_mocker(role="prefill", speedup=0)
    d_engine, d_client = await make_mocker(role="decode", speedup=0)
    params = (await prefill(p_client))["kv_transfer_params"]
    held = p_engine.held.count
    first = params["remote_block_ids"][0]
    twice = params | {"remote_block_ids": [first, first]}
    resp = await d_client.post("/v1/chat/completions", json=chat(PROMPT, kv_transfer_params=twice))
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "kv_transfer_params.remote_block_ids"
    assert "named twice" in error["message"]
    assert p_engine.held.count == held and p_engine.held.served_blocks == 0
    resp = await d_client.post("/v1/chat/completions", json=chat(PROMPT, kv_transfer_params=params))
    assert resp.status == 200, await resp.text()
    assert d_engine.kv_received_blocks == len(params["remote_block_ids"])


async def test_a_fetch_that_fails_in_the_side_channel_is_answered_and_the_channel_goes_on(
    make_mocker: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any error answering a fetch (not only a peer gone) killed the handler: the decode got
    no answer at all. Now it gets the error answer, and the next fetch is served."""
    from shoal.worker.engines.mocker import kv_transfer

    p_engine, p_client = await make_mocker(role="prefill", speedup=0)
    _, d_client = await make_mocker(role="decode", speedup=0)
    params = (await prefill(p_client))["kv_transfer_params"]
    take = kv_transfer.HeldBlocks.take
    monkeypatch.setattr(kv_transfer.HeldBlocks, "take", lambda *_: 1 // 0)
    resp = await d_client.post("/v1/chat/completions", json=chat(PROMPT, kv_transfer_params=params))
    assert resp.status == 400
    assert "failed in the prefill engine" in (await resp.json())["error"]["message"]
    monkeypatch.setattr(kv_transfer.HeldBlocks, "take", take)
    resp = await d_client.post("/v1/chat/completions", json=chat(PROMPT, kv_transfer_params=params))
    assert resp.status == 200, await resp.text()
    assert p_engine.held.served_blocks == len(params["remote_block_ids"])


class LoopGaps:
    """The longest time the event loop went without running a 1 ms ticker, while it runs."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def test_a_side_channel_fetch_naming_a_million_blocks_never_holds_the_loop(
    make_mocker: Make,
) -> None:
    """A fetch line was taken up to 8 MiB and decoded whole on the prefill worker's event
    loop, then checked for repeats: 7.6 MiB naming a million block ids held the loop for
    about 200 ms (its requests, its lease keepalive). Now a line is at most 2 MiB and a
    fetch naming more than `MAX_FETCH_BLOCKS` ids is refused before it is decoded, naming
    the bound; the next fetch is served."""
    from shoal.worker.engines.mocker import kv_transfer

    p_engine, p_client = await make_mocker(role="prefill", speedup=0)
    channel = p_engine.side_channel
    assert channel is not None
    ids = b",".join(str(1_000_000 + i).encode() for i in range(1_000_000))  # 7.6 MiB
    engine_id = p_engine.held.engine_id.encode()
    for line in (
        b'{"engine_id":"' + engine_id + b'","block_ids":[' + ids + b"]}\n",
        b'{"engine_id":"' + engine_id + b'","block_ids":[' + ids[:1_900_000] + b"]}\n",
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", channel.port)
        gaps = LoopGaps()
        try:
            writer.write(line)
            try:
                answer = await asyncio.wait_for(reader.readline(), 10)  # one answer, or the close
            except ConnectionResetError:  # (closed with what it sent unread)
                answer = b""
        finally:
            await gaps.stop()
            writer.close()
        assert gaps.longest < 0.05, f"the loop was held {gaps.longest * 1000:.0f} ms"
        assert answer == b"" or f"more than {kv_transfer.MAX_FETCH_BLOCKS}".encode() in answer
    _, d_client = await make_mocker(role="decode", speedup=0)
    params = (await prefill(p_client))["kv_transfer_params"]
    resp = await d_client.post("/v1/chat/completions", json=chat(PROMPT, kv_transfer_params=params))
    assert resp.status == 200, await resp.text()


async def test_a_side_channel_peer_that_sends_nothing_is_closed_after_the_idle_timeout(
    make_mocker: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The side channel kept a connection that sent nothing (or never read its answer) for
    good: file descriptors a prefill worker needs. Now one idle for `IDLE_TIMEOUT` is
    closed."""
    from shoal.worker.engines.mocker import kv_transfer

    monkeypatch.setattr(kv_transfer, "IDLE_TIMEOUT", 0.2, raising=False)
    p_engine, _ = await make_mocker(role="prefill", speedup=0)
    assert p_engine.side_channel is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", p_engine.side_channel.port)
    try:
        assert await asyncio.wait_for(reader.read(), 10) == b""
    finally:
        writer.close()
