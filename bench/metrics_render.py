"""The cost of a `/metrics` scrape over many models (not a test).

    .venv/bin/python -m bench.metrics_render [--models 10000] [--rounds 3]

A frontend's `FrontendMetrics` with `--models` models live, and 0, a tenth or all of them
with traffic (every status, histogram and counter set). Side by side in one run, per case:
`prometheus_client.generate_latest` of the registry (the per-model families through
`prometheus_client`, as `/metrics` wrote them before), `render()` (the same text, written
by `_PerModel`), and `render_sliced()`'s longest step between two yields to the event loop
(what a scrape holds the loop for). Best of `--rounds`, wall ms on one core.

    .venv/bin/python -m bench.metrics_render --fleet [--models 10000] [--rounds 3]

A frontend (not started) whose registry holds `--models` models of two instances each and
whose route table as many virtual models of two fleet targets each, joined in a random order
of names, with one request counted per virtual model: `render_sliced`'s longest step and its
total, and the reconciliation's dropping of the departed (`drop_departed_sliced`, or in one
piece on a tree without it), in CPU time of the loop's thread. Runs on any checkout
(`PYTHONPATH=DIR/src`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Awaitable, Callable

from prometheus_client import generate_latest

from shoal.cards import ModelCard
from shoal.discovery import FleetTarget, InstanceInfo, ModelInstance, ModelKey, Route
from shoal.frontend import Frontend, FrontendConfig
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
    return (await steps(metrics.render_sliced))[0]


async def steps(
    work: Callable[[], Awaitable[object]], clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """The longest stretch `work` runs without yielding, and its whole time, in seconds."""
    longest = 0.0
    start = last = clock()
    running = asyncio.ensure_future(work())
    while not running.done():
        await asyncio.sleep(0)
        now = clock()
        longest, last = max(longest, now - last), now
    return longest, last - start


def instance(instance_id: int, model: str) -> ModelInstance:
    card = ModelCard.build(
        display_name=model, slug=model, source=f"bench/{model}", model_types=["chat"],
        context_length=4096,
    )  # fmt: skip
    url = f"http://127.0.0.1:{10000 + instance_id % 50000}"
    info = InstanceInfo("default", "backend", "generate", instance_id, f"{url}/v1", url)
    return ModelInstance(ModelKey(info.endpoint_id, instance_id), card, info)


def frontend_fleet(models: int, cache_dir: str) -> Frontend:
    frontend = Frontend(FrontendConfig(port=0, cache_dir=cache_dir))  # type: ignore[arg-type]
    order = list(range(models))
    random.Random(1).shuffle(order)
    for i in order:
        for k in (1, 2):
            frontend.registry.join(instance(2 * i + k, f"model-{i:05d}"))
    for i in order:
        targets = (FleetTarget(f"model-{i:05d}"), FleetTarget(f"model-{(i + 1) % models:05d}"))
        route = Route(workspace="default", name=f"vm-{i:05d}", targets=targets)
        frontend.routes.put(route.key, route.to_json())
        frontend.metrics.model(f"vm-{i:05d}").count(200)
    return frontend


async def fleet_main(models: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as cache:
        frontend = frontend_fleet(models, cache)
        metrics = frontend.metrics
        # (CPU time of the loop's thread: on a shared machine, wall time is others' too)
        render = [await steps(metrics.render_sliced, time.thread_time) for _ in range(rounds)]

        async def in_one_piece() -> None:  # (a tree without `drop_departed_sliced`)
            metrics.drop_departed()

        drop_departed = getattr(metrics, "drop_departed_sliced", in_one_piece)
        drop = [await steps(drop_departed, time.thread_time) for _ in range(rounds)]
        print(
            "| models + routes | render_sliced longest step (CPU ms) | render_sliced total (CPU ms) "
            "| dropping the departed: longest step (CPU ms) |"
        )
        print("|---|---|---|---|")
        print(
            f"| {models:,} + {models:,} | {min(r[0] for r in render) * 1000:.1f} "
            f"| {min(r[1] for r in render) * 1000:.0f} | {min(d[0] for d in drop) * 1000:.1f} |"
        )
        frontend.routes.close()
        frontend.registry.close()


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
    parser.add_argument("--fleet", action="store_true", help="a registry and route table")
    args = parser.parse_args()
    if args.fleet:
        await fleet_main(args.models, args.rounds)
        return
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
