"""Hostile inputs around disaggregated serving: what a client or a prefill instance sends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest

from shoal.cards import WorkerRole
from shoal.frontend import Frontend, FrontendConfig
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.helpers import wait_for
from tests.processes import Processes


@pytest.fixture
async def frontend(tmp_path: Path) -> AsyncIterator[Frontend]:
    config = FrontendConfig(
        store_url=f"sqlite:///{tmp_path / 'store.db'}", port=0, cache_dir=tmp_path / "cache"
    )
    front = Frontend(config)
    await front.start()
    yield front
    await front.stop()


async def test_a_client_cannot_point_a_worker_at_a_host_of_its_choice_by_kv_transfer_params(
    processes: Processes, frontend: Frontend
) -> None:
    """`kv_transfer_params` make a worker connect where they say (a NIXL handshake, the
    mocker's side channel): only the gateway sets them, so a client's are refused, and no
    worker connects anywhere."""
    reached: list[int] = []

    async def note(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.append(1)
        writer.close()

    server = await asyncio.start_server(note, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store_url = frontend.config.store_url
    assert store_url is not None
    await processes.worker(store_url, "--lease-ttl", "3", "--ttft-ms", "1", "--itl-ms", "1")
    await wait_for(lambda: "mock-llm" in frontend.registry.models, timeout=20, message="ready")
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0)
    hostile = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": [1],
    }
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="mock-llm",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_body={"kv_transfer_params": hostile},
            )
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["param"] == "kv_transfer_params", refused.value.body
        assert reached == []
    finally:
        server.close()
        await server.wait_closed()


async def test_each_disaggregated_request_has_its_own_stage_request_id_and_keeps_the_clients(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """The stages of a request share one `X-Request-Id` (vLLM's connector matches the KV
    transfer by it), chosen by the frontend and new for each request: two requests a client
    sent under one id never meet on a prefill or a decode. The client's id stays its own: the
    answer's `X-Request-Id` (a decode echoing the stage id) is the client's."""
    prefill = await start_worker(component="prefill", role=WorkerRole.PREFILL)
    decode = await start_worker(component="decode", role=WorkerRole.DECODE)
    decode.echo_request_id = True
    frontend = await start_frontend()

    def two_stages() -> bool:
        model = frontend.registry.models.get("mock-llm")
        return model is not None and model.stages is not None

    await wait_for(two_stages, timeout=20, message="served in two stages")
    url = f"{frontend.url}/v1/chat/completions"
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        for stream in (False, True, False):
            async with session.post(
                url, json={**body, "stream": stream}, headers={"X-Request-Id": "client-1"}
            ) as response:
                assert response.status == 200, await response.text()
                assert response.headers.getall("X-Request-Id") == ["client-1"]
                await response.read()
        async with session.post(url, json=body) as response:  # no id of the client's
            assert response.status == 200
    stage_ids = [headers.getall("X-Request-Id") for headers in prefill.headers]
    assert stage_ids == [headers.getall("X-Request-Id") for headers in decode.headers]
    assert all(len(ids) == 1 for ids in stage_ids), stage_ids
    assert len({ids[0] for ids in stage_ids}) == 4 and ["client-1"] not in stage_ids, stage_ids
