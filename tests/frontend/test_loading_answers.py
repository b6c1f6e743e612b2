"""A frontend that serves while its first discovery listing loads answers a model it does
not hold yet with 503 and `Retry-After` (a retry finds it), not 404: a frontend restarted on
its port under load answered 404 for live models until it had loaded them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.registry.watcher import ModelWatcher
from tests.helpers import wait_for


async def test_a_model_asked_for_while_discovery_loads_is_503_retry_then_404_once_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    async def endless_load(self: ModelWatcher) -> None:  # the store answered; loading goes on
        self.store_answered.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(ModelWatcher, "start", endless_load)
    frontend = Frontend(
        FrontendConfig(store_url="memory://loading-answers", port=0, cache_dir=tmp_path)
    )
    starting = asyncio.create_task(frontend.start())  # (it serves while it loads)
    await wait_for(lambda: frontend.server is not None and frontend.server.port > 0)
    body = {"model": "not-yet", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as http:
            url = f"{frontend.url}/v1/chat/completions"
            async with http.post(url, json=body) as resp:
                answer = await resp.json()
                assert resp.status == 503, answer
                assert resp.headers.get("Retry-After") == "1"
                assert answer["error"]["code"] == "discovery_loading", answer
            assert frontend.watcher is not None
            frontend.watcher.snapshot_loaded.set()  # (the fleet is loaded: it holds no such model)
            async with http.post(url, json=body) as resp:
                answer = await resp.json()
                assert resp.status == 404, answer
                assert answer["error"]["code"] == "model_not_found", answer
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await frontend.stop()
