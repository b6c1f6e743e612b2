"""The supervisor's merged `/metrics` (`shoal frontend --processes N`): requests that come
at once share one scrape of the children, so a flood on the public API port's `/metrics`
costs the parent one scrape at a time, not N per request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from shoal.cli import processes
from shoal.cli.processes import Supervisor
from shoal.frontend import FrontendConfig
from shoal.frontend.registry.metrics import FrontendMetrics
from tests.helpers import LoopTurns, Server, wait_for


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


def large_frontend_metrics(models: int) -> str:
    """What a child of a large fleet with traffic answers (about 3 KB a model)."""
    metrics = FrontendMetrics()
    for i in range(models):
        stats = metrics.model(f"model-{i}")
        stats.count(200)
        stats.ttft.observe(0.1)
        stats.duration.observe(1.0)
    metrics.live_instances = lambda: {name: 1 for name in metrics.models}
    return metrics.render().decode()


async def test_merging_large_children_metrics_never_holds_the_parent_loop() -> None:
    """The parent parsed and wrote every child's text on its event loop, in one piece:
    1,000 models in two children held it 1.8 s (SIGTERM, the children's output and every
    other `/metrics` waited), and the child asking for the merge on the API port timed out
    at a large fleet's size."""
    text = large_frontend_metrics(1_000)
    servers = await serve_children(text, text)
    relabelled = LoopTurns().wrap(processes, "relabel")  # each child's text, where it is read
    try:
        request: Any = None
        response = await supervising(servers)._metrics(request)
    finally:
        await relabelled.stop()
        for server in servers:
            await server.stop()
    body = response.body
    assert isinstance(body, bytes)
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    requests = families["shoal_frontend_requests"].samples
    for slot in ("0", "1"):
        labels = {"model": "model-999", "status": "200", "process": slot}
        assert [s.value for s in requests if s.labels == labels] == [1.0]
    assert len(families["shoal_frontend_time_to_first_token_seconds"].samples) == 2 * 1_000 * 16
    assert relabelled.on_loop == 0 and relabelled.off_loop == 2  # in a thread, not timed


async def test_a_child_metrics_answer_over_the_bound_is_left_out_unread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child's `/metrics` that never ends was read for the whole scrape timeout: over
    loopback, gigabytes held in the parent's memory before the merge even began."""
    monkeypatch.setattr(processes, "MAX_CHILD_METRICS_BYTES", 1 << 20)
    sent = 0

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse()
        await response.prepare(request)
        chunk = b"# HELP endless An endless text.\n" * 2048
        while True:
            await response.write(chunk)
            sent += len(chunk)

    servers = await serve_children("# TYPE up gauge\nup 1.0\n", endless)  # type: ignore[arg-type]
    try:
        request: Any = None
        response = await asyncio.wait_for(supervising(servers)._metrics(request), 4)
    finally:
        for server in servers:
            await server.stop()
    body = response.body
    assert isinstance(body, bytes) and b'up{process="0"} 1.0' in body
    assert b"endless" not in body
    assert sent < 32 << 20  # the bound, and what the sockets' buffers took


def test_merge_replaces_only_a_real_process_label_never_edits_a_label_value() -> None:
    """`relabel` stripped `,process="..."` wherever it appeared, inside a quoted value too:
    a model named `x,process=` lost its status label into its model label."""
    child = FrontendMetrics()
    child.live_instances = lambda: {"x,process=": 1}
    stats = child.model("x,process=")
    stats.count(200)
    stats.count(500)
    text = child.render().decode()
    text += '# TYPE own gauge\nown{a="1",process="9",b="process=\\"2\\""} 1.0\n'
    got: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for family in text_string_to_metric_families(processes.merge({0: text}).decode()):
        for s in family.samples:
            if s.name in ("shoal_frontend_requests_total", "own"):
                got.add((s.name, tuple(sorted(s.labels.items()))))
    assert got == {
        (
            "shoal_frontend_requests_total",
            (("model", "x,process="), ("process", "0"), ("status", "200")),
        ),
        (
            "shoal_frontend_requests_total",
            (("model", "x,process="), ("process", "0"), ("status", "500")),
        ),
        ("own", (("a", "1"), ("b", 'process="2"'), ("process", "0"))),
    }
