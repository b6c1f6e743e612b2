"""The cost of a `/metrics` scrape over many models (not a test).

    .venv/bin/python -m bench.metrics_render [--models 10000] [--rounds 3]

A frontend's `FrontendMetrics` with `--models` models live, and 0, a tenth or all of them
with traffic (every status, histogram and counter set). Side by side in one run, per case:
`prometheus_client.generate_latest` of the registry (the per-model families through
`prometheus_client`, as `/metrics` wrote them before), `render()` (the same text, written
by `_PerModel`), and `render_sliced()`'s longest step between two yields to the event loop
(what a scrape holds the loop for). Best of `--rounds`, wall ms on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from prometheus_client import generate_latest

from shoal.frontend.registry.metrics import FrontendMetrics


def fleet(models: int, with_traffic: int) -> FrontendMetrics:
    metrics = FrontendMetrics()
    live = {f"model-{i:05d}": 10 for i in range(models)}
    metrics.live_instances = lambda: dict(live)
    for i in range(with_traffic):
        stats = metrics.model(f"model-{i:05d}")
        stats.count(200)
        stats.count(429)
        stats.retries = 1
        stats.ttft.observe(0.2)
        stats.duration.observe(1.5)
    return metrics


async def longest_step(metrics: FrontendMetrics) -> float:
    """The longest stretch `render_sliced` runs without yielding, in seconds."""
    longest, last = 0.0, time.perf_counter()
    rendering = asyncio.ensure_future(metrics.render_sliced())
    while not rendering.done():
        await asyncio.sleep(0)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest


def best(fn: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        "| models with traffic | lines | generate_latest (ms) | render (ms) | render_sliced longest step (ms) |"
    )
    print("|---|---|---|---|---|")
    for with_traffic in (0, args.models // 10, args.models):
        metrics = fleet(args.models, with_traffic)
        before = best(lambda m=metrics: generate_latest(m.registry), args.rounds)
        after = best(metrics.render, args.rounds)
        step = min([await longest_step(metrics) for _ in range(args.rounds)])
        lines = metrics.render().count(b"\n")
        print(
            f"| {with_traffic:,} | {lines:,} | {before * 1000:.1f} | {after * 1000:.1f} | {step * 1000:.1f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
