"""Disaggregated serving end to end: real prefill and decode mockers, the official openai client."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from shoal.discovery import FleetTarget, Route, publish_route
from shoal.frontend import Frontend, FrontendConfig
from shoal.store import open_store
from tests.frontend.test_disagg_large_bodies import count_large_work
from tests.helpers import wait_for
from tests.processes import Process, Processes

PROMPT = "Tell me a story about a lighthouse keeper and the sea. " * 8
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
FAST = ("--lease-ttl", "3", "--ttft-ms", "5", "--itl-ms", "2")


@pytest.fixture
async def frontend(tmp_path: Path) -> AsyncIterator[Frontend]:
    config = FrontendConfig(
        store_url=f"sqlite:///{tmp_path / 'store.db'}",
        port=0,
        cache_dir=tmp_path / "cache",
        retries=2,
        inhibit_seconds=10.0,
        drain_timeout=2.0,
    )
    front = Frontend(config)
    await front.start()
    yield front
    await front.stop()


async def stage_worker(processes: Processes, frontend: Frontend, role: str) -> Process:
    store_url = frontend.config.store_url
    assert store_url is not None
    return await processes.worker(store_url, "--role", role, "--component", role, *FAST)


async def counters(http: aiohttp.ClientSession, worker: Process) -> dict[str, float]:
    """The mocker's counters of disaggregated serving, from its status server."""
    async with http.get(f"{worker.status_url}/metrics") as resp:
        text = await resp.text()
    wanted = (
        "remote_prefills",
        "remote_decodes",
        "computed_prompt_tokens",
        "kv_received_blocks",
        "kv_sent_blocks",
    )
    values: dict[str, float] = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        for name in wanted:
            if line.startswith(f"shoal_mocker_{name}_total{{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def stages_ready(frontend: Frontend, prefill: int, decode: int) -> bool:
    model = frontend.registry.models.get("mock-llm")
    stages = None if model is None else model.stages
    return (
        stages is not None
        and stages.prefill.live_instances == prefill
        and stages.decode.live_instances == decode
    )


async def test_each_request_is_prefilled_on_one_instance_and_decoded_on_another(
    processes: Processes, frontend: Frontend
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0)
    first = await stage_worker(processes, frontend, "prefill")
    # A prefill set alone: incomplete, not listed, the reason in /health.
    async with aiohttp.ClientSession() as http:

        async def health_reason() -> str | None:
            async with http.get(f"{frontend.url}/health") as resp:
                body = await resp.json()
            model = body["models"].get("mock-llm")
            return None if model is None else model["incomplete"]

        reason = await wait_for(health_reason, timeout=20, message="the model is incomplete")
        assert "no decode set" in reason
        assert [m.id for m in (await client.models.list()).data] == []
        with pytest.raises(openai.APIStatusError) as waiting:
            await client.chat.completions.create(model="mock-llm", messages=CHAT)
        assert waiting.value.status_code == 503 and "no decode set" in waiting.value.message
        prefills = [first, await stage_worker(processes, frontend, "prefill")]
        decodes = list(
            await asyncio.gather(*(stage_worker(processes, frontend, "decode") for _ in range(2)))
        )
        await wait_for(lambda: stages_ready(frontend, 2, 2), timeout=20, message="2P+2D serve")
        assert [m.id for m in (await client.models.list()).data] == ["mock-llm"]
        assert await health_reason() is None
        decode_ids = {f"{w.instance_id:x}" for w in decodes}

        async def totals(workers: list[Process]) -> dict[str, float]:
            each = await asyncio.gather(*(counters(http, w) for w in workers))
            return {k: sum(c[k] for c in each) for k in each[0]}

        for kind, stream in [("chat", False), ("chat", True), ("text", False), ("text", True)]:
            before_p, before_d = await totals(prefills), await totals(decodes)
            if kind == "chat":
                raw = await client.chat.completions.with_raw_response.create(
                    model="mock-llm",
                    messages=CHAT,
                    max_tokens=7,
                    stream=stream,
                    **({"stream_options": {"include_usage": True}} if stream else {}),
                )
            else:
                raw = await client.completions.with_raw_response.create(
                    model="mock-llm",
                    prompt=PROMPT,
                    max_tokens=7,
                    stream=stream,
                    **({"stream_options": {"include_usage": True}} if stream else {}),
                )
            assert raw.headers["x-shoal-instance"] in decode_ids  # the decode answered
            answer = raw.parse()
            if stream:
                chunks = [chunk async for chunk in answer]  # type: ignore[union-attr]
                usages = [c.usage for c in chunks if c.usage is not None]
                assert len(usages) == 1  # the decode's, once
                usage = usages[0]
            else:
                usage = answer.usage  # type: ignore[union-attr]
            assert usage is not None and usage.completion_tokens == 7
            after_p, after_d = await totals(prefills), await totals(decodes)
            assert after_p["remote_prefills"] - before_p["remote_prefills"] == 1, kind
            assert after_d["remote_decodes"] - before_d["remote_decodes"] == 1, kind
            assert after_p["remote_decodes"] == before_p["remote_decodes"] == 0
            # The prompt was computed by the prefill, and by no decode: its blocks came over.
            computed = after_p["computed_prompt_tokens"] - before_p["computed_prompt_tokens"]
            assert computed == usage.prompt_tokens
            assert after_d["computed_prompt_tokens"] == 0
            received = after_d["kv_received_blocks"] - before_d["kv_received_blocks"]
            assert received == -(-usage.prompt_tokens // 16)
            assert after_p["kv_sent_blocks"] - before_p["kv_sent_blocks"] == received
        # A request the prefill refuses is answered with its refusal; no decode starts.
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="mock-llm", messages=CHAT, temperature=5)
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "temperature"
        assert (await totals(decodes))["remote_decodes"] == 4
    prefill_seconds = frontend.metrics.registry.get_sample_value(
        "shoal_frontend_disagg_prefill_seconds_count"
    )
    assert prefill_seconds == 4


class Clients:
    """A few openai clients in a loop, half streaming, recording every outcome."""

    def __init__(self, url: str) -> None:
        self.client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        self.stop = asyncio.Event()
        self.ok = 0
        self.failed_before_first_byte: list[str] = []

    async def run(self, n: int) -> None:
        while not self.stop.is_set():
            received = 0
            try:
                if n % 2:
                    stream = await self.client.chat.completions.create(
                        model="mock-llm", messages=CHAT, max_tokens=8, stream=True
                    )
                    async for _ in stream:
                        received += 1
                else:
                    await self.client.completions.create(
                        model="mock-llm", prompt=PROMPT, max_tokens=8
                    )
                self.ok += 1
            except openai.APIError as exc:
                if not received:
                    self.failed_before_first_byte.append(repr(exc))


@pytest.mark.parametrize("victim", ["prefill", "decode"])
async def test_a_stage_worker_killed_under_load_fails_no_request_before_its_first_byte(
    processes: Processes, frontend: Frontend, victim: str
) -> None:
    workers = await asyncio.gather(
        *(stage_worker(processes, frontend, role) for role in ("prefill", "decode") * 2)
    )
    await wait_for(lambda: stages_ready(frontend, 2, 2), timeout=20, message="2P+2D serve")
    clients = Clients(frontend.url)
    tasks = [asyncio.create_task(clients.run(n)) for n in range(4)]
    try:
        await wait_for(lambda: clients.ok >= 20, timeout=30)  # the pools are warm
        workers[0 if victim == "prefill" else 1].signal(signal.SIGKILL)
        before = clients.ok
        await wait_for(lambda: clients.ok >= before + 60, timeout=60)
    finally:
        clients.stop.set()
        await asyncio.gather(*tasks)
    assert clients.failed_before_first_byte == []
    sample = frontend.metrics.registry.get_sample_value
    failures = sample("shoal_frontend_disagg_stage_failures_total", {"stage": victim}) or 0
    # The dead one was met: by a request before its first byte (a stage failure), or, for a
    # decode, by streams it was serving, which moved to the other decode (a migration; the
    # instance is then inhibited, so no later request need meet it).
    moved = sum(
        metric.value
        for family in frontend.metrics.registry.collect()
        if family.name == "shoal_frontend_migrations"
        for metric in family.samples
        if metric.name.endswith("_total") and metric.labels.get("outcome") == "attempted"
    )
    assert failures + (moved if victim == "decode" else 0) >= 1


async def test_a_client_that_leaves_during_prefill_cancels_it_and_no_decode_starts(
    processes: Processes, frontend: Frontend
) -> None:
    store_url = frontend.config.store_url
    assert store_url is not None
    prefill, decode = await asyncio.gather(
        processes.worker(store_url, "--role", "prefill", "--component", "p", "--ttft-ms", "5000"),
        stage_worker(processes, frontend, "decode"),
    )
    await wait_for(lambda: stages_ready(frontend, 1, 1), timeout=20, message="1P+1D serve")
    body = json.dumps({"model": "mock-llm", "messages": CHAT, "max_tokens": 4}).encode()
    request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-length: %d\r\n\r\n%s"
    async with aiohttp.ClientSession() as http:

        async def prefill_says(line: str) -> bool:
            async with http.get(f"{prefill.status_url}/metrics") as resp:
                return line in await resp.text()

        _, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
        writer.write(request % (len(body), body))
        running = (
            'shoal_mocker_active_sequences{endpoint="default.p.generate",model="mock-llm"} 1.0'
        )
        await wait_for(lambda: prefill_says(running), timeout=10, message="the prefill runs")
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()  # a reset: the client is gone
        cancelled = 'cancelled_sequences_total{endpoint="default.p.generate",model="mock-llm"} 1.0'
        await wait_for(lambda: prefill_says(cancelled), timeout=10, message="prefill cancelled")
        assert (await counters(http, decode))["remote_decodes"] == 0
        async with http.get(f"{decode.status_url}/metrics") as resp:
            assert 'kind="chat",model="mock-llm"} 0.0' in await resp.text()  # no decode started
    model = frontend.registry.models["mock-llm"]
    assert model.stages is not None
    assert [u.in_flight for ws in model.stages.prefill.routable_sets for u in ws.routable] == [0]


async def test_with_the_kv_router_prefills_go_where_the_prompt_is_cached(
    processes: Processes, tmp_path: Path
) -> None:
    store_url = f"sqlite:///{tmp_path / 'kv.db'}"
    config = FrontendConfig(
        store_url=store_url, port=0, cache_dir=tmp_path / "kv-cache", router="kv"
    )
    frontend = Frontend(config)
    await frontend.start()
    try:
        kv = ("--kv-events-port", "0")
        prefills = list(
            await asyncio.gather(
                *(
                    processes.worker(store_url, "--role", "prefill", "--component", "p", *kv, *FAST)
                    for _ in range(2)
                )
            )
        )
        await processes.worker(store_url, "--role", "decode", "--component", "d", *FAST)
        await wait_for(lambda: stages_ready(frontend, 2, 1), timeout=20, message="2P+1D serve")
        client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0)
        for _ in range(4):
            await client.chat.completions.create(model="mock-llm", messages=CHAT, max_tokens=2)
        async with aiohttp.ClientSession() as http:
            each = [(await counters(http, w))["remote_prefills"] for w in prefills]
        assert sorted(each) == [0, 4]  # one instance holds the prompt: every prefill went there
        picks = frontend.metrics.registry.get_sample_value("shoal_frontend_kv_picks_total")
        assert picks is not None and picks >= 4
    finally:
        await frontend.stop()


async def test_an_alias_of_a_disaggregated_model_is_served_in_two_stages(
    processes: Processes, frontend: Frontend
) -> None:
    store_url = frontend.config.store_url
    assert store_url is not None
    prefill, decode = await asyncio.gather(
        stage_worker(processes, frontend, "prefill"), stage_worker(processes, frontend, "decode")
    )
    await wait_for(lambda: stages_ready(frontend, 1, 1), timeout=20, message="1P+1D serve")
    store = await open_store(store_url)
    try:
        await publish_route(store, Route("default", "storyteller", (FleetTarget("mock-llm"),)))
    finally:
        await store.close()
    await wait_for(lambda: "storyteller" in frontend.routes.models, message="the alias is served")
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="storyteller", messages=CHAT, max_tokens=5, stream=True
    )
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    async with aiohttp.ClientSession() as http:
        assert (await counters(http, prefill))["remote_prefills"] == 1
        assert (await counters(http, decode))["remote_decodes"] == 1
        assert (await counters(http, decode))["computed_prompt_tokens"] == 0


@pytest.mark.parametrize("name", ["mock-llm", "storyteller"])  # the model, an alias of it
async def test_a_decode_dying_mid_stream_is_continued_on_another_decode_with_the_same_text(
    processes: Processes, frontend: Frontend, name: str
) -> None:
    store_url = frontend.config.store_url
    assert store_url is not None
    if name != "mock-llm":
        store = await open_store(store_url)
        try:
            await publish_route(store, Route("default", name, (FleetTarget("mock-llm"),)))
        finally:
            await store.close()
        await wait_for(lambda: name in frontend.routes.models, message="the alias is served")
    decode = ("--role", "decode", "--component", "decode", *FAST)
    await asyncio.gather(
        stage_worker(processes, frontend, "prefill"),
        processes.worker(store_url, *decode, "--die-after-tokens", "4"),
        processes.worker(store_url, *decode),
    )
    await wait_for(lambda: stages_ready(frontend, 1, 2), timeout=20, message="1P+2D serve")
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0)
    texts = []
    for _ in range(2):  # one of the two goes to the decode that dies (ties go round-robin)
        stream = await client.chat.completions.create(
            model=name, messages=CHAT, max_tokens=12, stream=True
        )
        texts.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
    assert texts[0] == texts[1] and texts[0]  # the migrated stream: the same text, whole
    attempted = sum(
        sample.value
        for family in frontend.metrics.registry.collect()
        if family.name == "shoal_frontend_migrations"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("outcome") == "attempted"
    )
    assert attempted == 1


async def test_a_virtual_model_of_several_targets_serves_its_disaggregated_one_in_two_stages(
    processes: Processes, frontend: Frontend
) -> None:
    prefill, decode = await asyncio.gather(
        stage_worker(processes, frontend, "prefill"), stage_worker(processes, frontend, "decode")
    )
    await wait_for(lambda: stages_ready(frontend, 1, 1), timeout=20, message="1P+1D serve")
    store_url = frontend.config.store_url
    assert store_url is not None
    store = await open_store(store_url)
    try:  # the other target serves nothing now: every request goes to the disaggregated one
        targets = (FleetTarget("mock-llm", weight=1), FleetTarget("absent", weight=1))
        await publish_route(store, Route("default", "storyteller", targets))
    finally:
        await store.close()
    await wait_for(lambda: "storyteller" in frontend.routes.models, message="the route is served")
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0)
    for _ in range(3):
        answer = await client.chat.completions.create(
            model="storyteller", messages=CHAT, max_tokens=3
        )
        assert answer.choices[0].message.content
    async with aiohttp.ClientSession() as http:
        assert (await counters(http, prefill))["remote_prefills"] == 3
        assert (await counters(http, decode))["remote_decodes"] == 3


async def test_a_1_mb_prompt_reaches_both_stages_exactly_and_is_rebuilt_off_the_loop(
    processes: Processes, frontend: Frontend
) -> None:
    """The prefill computes the prompt, the decode takes every block of it and echoes the
    prompt it got: the client's, character for character; the gateway parsed the body once,
    in its decoder, and built neither stage's body on the loop."""
    store_url = frontend.config.store_url
    assert store_url is not None
    room = ("--context-length", "1000000", "--kv-blocks", "131072")
    prefill, decode = await asyncio.gather(
        processes.worker(store_url, "--role", "prefill", "--component", "prefill", *FAST, *room),
        processes.worker(store_url, "--role", "decode", "--component", "decode", *FAST, *room),
    )
    await wait_for(lambda: stages_ready(frontend, 1, 1), timeout=20, message="1P+1D serve")
    words = 'The keeper\'s "lamp" burns over the sea; caf\u00e9 na\u00efve\ttide. '
    prompt = (words * (1_000_000 // len(words) + 1))[:1_000_000]
    body = msgspec.json.encode(
        {"model": "mock-llm", "prompt": prompt, "max_tokens": 3, "echo": True}
    )
    whole, large = count_large_work(body)
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{frontend.url}/v1/completions", data=body) as resp,
        ):
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
    finally:
        await whole.stop()
        await large.stop()
    assert (whole.on_loop, whole.off_loop) == (0, 1)
    assert large.on_loop == 0, large.per_turn
    text = answer["choices"][0]["text"]
    assert text.startswith(prompt) and len(text) > len(prompt)  # the prompt the decode got
    usage = answer["usage"]
    async with aiohttp.ClientSession() as http:
        prefilled, decoded = await counters(http, prefill), await counters(http, decode)
    assert prefilled["remote_prefills"] == 1 and decoded["remote_decodes"] == 1
    assert prefilled["computed_prompt_tokens"] == usage["prompt_tokens"] > 100_000
    assert decoded["computed_prompt_tokens"] == 0  # every block of its prompt came over
    assert decoded["kv_received_blocks"] == -(-usage["prompt_tokens"] // 16)
