"""The supervisor's merged `/metrics` (`shoal frontend --processes N`): requests that come
at once share one scrape of the children, so a flood on the public API port's `/metrics`
costs the parent one scrape at a time, not N per request."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from shoal.cli.processes import Supervisor
from shoal.frontend import FrontendConfig
from tests.helpers import Server, wait_for


async def test_metrics_asked_at_once_share_one_scrape_of_each_child() -> None:
    hits = 0
    release = asyncio.Event()

    async def child_metrics(_: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        await release.wait()
        return web.Response(text="# TYPE up gauge\nup 1.0\n")

    app = web.Application()
    app.router.add_get("/metrics", child_metrics)
    child = Server(app)
    await child.start()
    try:
        supervisor = Supervisor(FrontendConfig(port=0), 2)
        for slot in supervisor.children:
            slot.metrics_url = f"{child.url}/metrics"
        request: Any = None
        answers = [asyncio.ensure_future(supervisor._metrics(request)) for _ in range(50)]
        await wait_for(lambda: hits >= 2)  # (every request entered `_metrics` before that)
        release.set()
        bodies = [response.body for response in await asyncio.gather(*answers)]
    finally:
        await child.stop()
    assert hits == 2  # one per child, for all 50 requests
    assert all(b'up{process="1"} 1.0' in body for body in bodies)  # type: ignore[operator]
