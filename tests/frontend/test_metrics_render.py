"""`/metrics`' per-model series, written as text a slice of models at a time (metrics.py)."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest

from shoal.frontend.registry.metrics import RENDER_SLICE, FrontendMetrics

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
