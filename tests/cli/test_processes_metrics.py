"""The supervisor's merged `/metrics` (`shoal frontend --processes N`): requests that come
at once share one scrape of the children, so a flood on the public API port's `/metrics`
costs the parent one scrape at a time, not N per request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
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


async def serve_children(*answers: web.StreamResponse | str) -> list[Server]:
    """One stand-in child `/metrics` server per answer (a text, or a handler's response)."""
    servers = []
    for answer in answers:

        async def child_metrics(_: web.Request, answer: Any = answer) -> web.StreamResponse:
            return web.Response(text=answer) if isinstance(answer, str) else await answer(_)

        app = web.Application()
        app.router.add_get("/metrics", child_metrics)
        server = Server(app)
        await server.start()
        servers.append(server)
    return servers


def supervising(servers: list[Server]) -> Supervisor:
    supervisor = Supervisor(FrontendConfig(port=0), len(servers))
    for slot, server in zip(supervisor.children, servers, strict=True):
        slot.metrics_url = f"{server.url}/metrics"
    return supervisor


@pytest.mark.parametrize("garbage", ["<html>not metrics</html>\n", " {, =.P\n_ H{,H+#{-_"])
async def test_a_child_answering_garbage_is_left_out_and_the_others_are_merged(
    garbage: str,
) -> None:
    """One child's `/metrics` that is not the text format (a bug, a wrong port answering)
    made the merge raise: the parent's `/metrics` answered 500 for every child."""
    good = "# HELP up Up.\n# TYPE up gauge\nup 1.0\n"
    servers = await serve_children(good, garbage, good)
    try:
        request: Any = None
        response = await supervising(servers)._metrics(request)
    finally:
        for server in servers:
            await server.stop()
    body = response.body
    assert isinstance(body, bytes) and response.status == 200
    assert b'up{process="0"} 1.0' in body and b'up{process="2"} 1.0' in body
    lines = body.decode().splitlines()
    assert [
        x for x in lines if 'process="1"' in x and not x.startswith("shoal_frontend_process")
    ] == []
