"""A request leaves nothing for the garbage collector: every object the request path makes
is freed by its reference count when the request ends. Cycles (a `Forward` and the
`Migration` riding along it) kept a stream's objects, and its last packet, alive until the
next collection: the heap's top grew by each stream's size and was trimmed again, page
faults on every request (bench/request_path.py, mode `whole`), and more for the collector to
walk. Served through the frontend's real request path over fake transports
(`bench.request_path.Bench`), with the collector off while the requests run."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from bench.request_path import Bench

REQUESTS = 20


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("instances", [1, 2])
@pytest.mark.parametrize("mode", ["plain", "stream", "whole"])
async def test_a_request_leaves_no_cycle_for_the_collector(
    mode: str, instances: int, collector_off: None
) -> None:
    bench = Bench(chunks=16, instances=instances)
    bench.serve(mode, 2)  # (what the first requests make once: caches, the pool)
    gc.collect()
    bench.serve(mode, REQUESTS)
    left = gc.collect()
    bench.check()
    assert left == 0, f"{REQUESTS} {mode} requests left {left} objects in cycles"
