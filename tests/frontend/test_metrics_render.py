"""`/metrics`' per-model series, written as text a slice of models at a time (metrics.py)."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest.mock import patch

from prometheus_client import generate_latest

from shoal.frontend.registry.metrics import RENDER_SLICE, FrontendMetrics, _PerModel

NAMES = ["plain", 'a "quoted" one', "back\\slash", "new\nline", "ünïcode", "no traffic"]


def metrics_with_traffic(names: list[str]) -> FrontendMetrics:
    metrics = FrontendMetrics()
    metrics.live_instances = lambda: {name: i for i, name in enumerate(names)}
    for i, name in enumerate(names[:-1]):
        stats = metrics.model(name)
        stats.count(200)
        stats.count(503 if i % 2 else 200)
        stats.retries, stats.in_flight = i, i % 3
        stats.ttft.observe(0.02 * i)
        stats.duration.observe(1e-9 + i * 7.5)
        stats.duration.observe(1e12)  # past the last bound
    for name in names[1::2]:  # (refused cards: models with requests here or none)
        metrics.card_refused(name)
    metrics.card_refused(names[1])
    return metrics


def test_the_per_model_series_are_written_as_prometheus_client_writes_them() -> None:
    """Line for line what `generate_latest` writes of the same families (the registry the
    tests read still holds them): names with quotes, backslashes, newlines, non-ASCII."""
    metrics = metrics_with_traffic(NAMES)
    ours = metrics.render().decode()
    theirs = generate_latest(metrics.registry).decode()
    assert sorted(ours.splitlines()) == sorted(theirs.splitlines())
    assert 'shoal_frontend_requests_total{model="a \\"quoted\\" one",status="503"} 1.0' in ours
    assert 'shoal_frontend_live_instances{model="new\\nline"} 3.0' in ours
    assert 'shoal_frontend_cards_refused_total{model="a \\"quoted\\" one"} 2.0' in ours


def test_each_family_is_written_in_one_piece() -> None:
    """The text format wants every sample of a family after its TYPE line, before the next."""
    text = metrics_with_traffic(NAMES).render().decode()
    families: list[str] = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            families.append(line.split()[2])
        elif not line.startswith("#"):
            assert line.startswith(families[-1]), line
    assert len(families) == len(set(families))


async def test_a_scrape_of_many_models_lets_the_event_loop_run_between_slices() -> None:
    """`render_sliced` yields after every `RENDER_SLICE` models: the loop runs other work
    while 10,000 models' series are written, and the text is what `render` writes."""
    names = [f"model-{i:05d}" for i in range(10_000)]
    metrics = metrics_with_traffic(names)
    turns = 0
    rendering = asyncio.ensure_future(metrics.render_sliced())
    while not rendering.done():
        turns += 1
        await asyncio.sleep(0)
    assert turns >= len(names) // RENDER_SLICE
    text = b"".join(rendering.result())
    assert sorted(text.splitlines()) == sorted(metrics.render().splitlines())


def test_a_collector_another_layer_registers_is_rendered_too() -> None:
    """What the KV router or the control loops register on the frontend's registry is in
    `/metrics`, beside the per-model series written as text."""
    from prometheus_client import Gauge

    metrics = metrics_with_traffic(NAMES)
    Gauge(
        "shoal_test_registered_later", "A collector of another layer.", registry=metrics.registry
    ).set(3)
    text = metrics.render().decode()
    assert "shoal_test_registered_later 3.0" in text
    assert text.count("# TYPE shoal_frontend_live_instances gauge") == 1


async def test_refused_cards_are_written_a_slice_at_a_time_not_in_one_piece() -> None:
    """The `cards_refused` family was a `prometheus_client` counter written in one piece
    with the rest of the registry, and every series of it walked again at each scrape to
    find the departed (2,000 refused cards: a 97 ms turn of the event loop). Now its series
    are written with the per-model ones, `RENDER_SLICE * 8` per turn at most."""
    names = [f"org/adapter-{i:05d}" for i in range(20_000)]
    metrics = FrontendMetrics()
    for name in names:
        metrics.card_refused(name)
    written: dict[int, int] = {}  # turn of the loop -> refused series written in it
    turns = 0
    add_counts = _PerModel.add_counts

    def counted(text: _PerModel, family: int, counts: Any) -> None:
        if family == -1:
            written[turns] = written.get(turns, 0) + len(counts)
        add_counts(text, family, counts)

    with patch.object(_PerModel, "add_counts", counted):
        rendering = asyncio.ensure_future(metrics.render_sliced())
        while not rendering.done():
            turns += 1
            await asyncio.sleep(0)
    pieces = rendering.result()
    assert b"cards_refused_total{" not in pieces[0]  # (not in the registry's text)
    assert sum(written.values()) == len(names)
    assert max(written.values()) <= RENDER_SLICE * 8
    text = b"".join(pieces).decode()
    assert text.count("\nshoal_frontend_cards_refused_total{") == len(names)
