"""The `openai` sidecar in disaggregated serving: it announces its role and relays vLLM's
`kv_transfer_params` unchanged both ways (to a fake vLLM that checks them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
from aiohttp import web

from shoal.cards import WorkerRole
from shoal.frontend import Frontend, FrontendConfig
from shoal.worker.engines.openai_sidecar import OpenAISidecarEngine
from tests.helpers import serving, wait_for
from tests.processes import Processes
from tests.worker.engines.support import engine_served

MODEL = "fake/vllm"
STAGE_ONE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
HANDLE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [3, 1, 4, 1, 5],
    "remote_engine_id": "9f2c-prefill",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
}


def fake_vllm(role: str, seen: list[dict[str, Any]]) -> web.Application:
    """A vLLM server with the NixlConnector as a `role` instance: refuses (400) any request
    whose `kv_transfer_params` are not what the protocol sends that role."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        seen.append(body)
        expected = STAGE_ONE if role == "prefill" else HANDLE
        whole = body.get("max_tokens") == 1 and body.get("stream") is False
        if body.get("kv_transfer_params") != expected or (role == "prefill" and not whole):
            return web.json_response({"error": {"message": "bad kv_transfer_params"}}, status=400)
        answer: dict[str, Any] = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
            "kv_transfer_params": HANDLE if role == "prefill" else None,
        }
        return web.json_response(answer)

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_the_sidecar_announces_its_role_and_relays_kv_transfer_params_both_ways() -> None:
    seen_p: list[dict[str, Any]] = []
    seen_d: list[dict[str, Any]] = []
    async with (
        serving(fake_vllm("prefill", seen_p)) as vllm_p,
        serving(fake_vllm("decode", seen_d)) as vllm_d,
        engine_served(OpenAISidecarEngine(vllm_p.url, role="prefill", health_interval=0.0)) as (
            engine_p,
            side_p,
        ),
        engine_served(OpenAISidecarEngine(vllm_d.url, role="decode", health_interval=0.0)) as (
            engine_d,
            side_d,
        ),
        aiohttp.ClientSession() as http,
    ):
        assert [m.role for m in await engine_p.served_models()] == [WorkerRole.PREFILL]
        assert [m.role for m in await engine_d.served_models()] == [WorkerRole.DECODE]
        messages = [{"role": "user", "content": "hi"}]
        stage_one = {"model": MODEL, "messages": messages, "max_tokens": 1, "stream": False}
        async with http.post(
            f"{side_p.url}/v1/chat/completions", json=stage_one | {"kv_transfer_params": STAGE_ONE}
        ) as resp:
            assert resp.status == 200, await resp.text()
            handle = (await resp.json())["kv_transfer_params"]
        assert handle == HANDLE and seen_p[0]["kv_transfer_params"] == STAGE_ONE
        stage_two = {"model": MODEL, "messages": messages, "kv_transfer_params": handle}
        async with http.post(f"{side_d.url}/v1/chat/completions", json=stage_two) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["kv_transfer_params"] is None
        assert seen_d[0]["kv_transfer_params"] == HANDLE


async def test_a_frontend_serves_vllm_prefill_and_decode_servers_behind_sidecars(
    processes: Processes, tmp_path: Path
) -> None:
    seen_p: list[dict[str, Any]] = []
    seen_d: list[dict[str, Any]] = []
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    frontend = Frontend(FrontendConfig(store_url=store_url, port=0, cache_dir=tmp_path / "c"))
    await frontend.start()
    try:
        async with (
            serving(fake_vllm("prefill", seen_p)) as vllm_p,
            serving(fake_vllm("decode", seen_d)) as vllm_d,
        ):
            for role, url in (("prefill", vllm_p.url), ("decode", vllm_d.url)):
                await processes.worker(
                    store_url, "--upstream", url, "--role", role, "--component", role,
                    engine="openai", model=MODEL,
                )  # fmt: skip

            def served() -> bool:
                model = frontend.registry.models.get(MODEL)
                return model is not None and model.stages is not None

            await wait_for(served, timeout=20, message="both stages serve")
            client = openai.AsyncOpenAI(
                base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0
            )
            answer = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20
            )
            assert answer.choices[0].message.content == "Hi"
            assert [b["kv_transfer_params"] for b in seen_p] == [STAGE_ONE]
            assert [b["kv_transfer_params"] for b in seen_d] == [HANDLE]
            assert seen_d[0]["max_tokens"] == 20  # the client's own request, with the handle
            assert "stream" not in seen_d[0]
    finally:
        await frontend.stop()
