"""The mocker's Prometheus metrics: its slots, queue, simulated KV cache and token counts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shoal.worker.engines.mocker.prefix_cache import PrefixCache


class MockerState(Protocol):
    """What the metrics read: the engine's public counters (`MockerEngine` has them)."""

    model: str
    max_seqs: int
    cache: PrefixCache
    active_sequences: int
    waiting_requests: int
    cancelled_sequences: int
    requests: dict[str, int]
    prompt_tokens: int
    generation_tokens: int


def mocker_metrics(state: MockerState) -> Iterator[Metric]:
    """One sample per metric, labelled with the model, read from `state` now."""
    cache = state.cache
    gauges = (
        ("shoal_mocker_active_sequences", "Sequences holding a slot.", state.active_sequences),
        ("shoal_mocker_waiting_requests", "Requests queued for a slot.", state.waiting_requests),
        ("shoal_mocker_max_sequences", "Concurrent sequence slots.", state.max_seqs),
        ("shoal_mocker_kv_blocks_total", "Simulated KV cache blocks.", cache.capacity),
        (
            "shoal_mocker_kv_blocks_used",
            "KV blocks held by running sequences.",
            cache.blocks_in_use,
        ),
        ("shoal_mocker_kv_usage_ratio", "Share of KV blocks in use.", cache.usage),
        ("shoal_mocker_prefix_cache_blocks", "Block hashes in the prefix cache.", len(cache)),
    )
    counters = (
        (
            "shoal_mocker_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache.",
            cache.queried_tokens,
        ),
        (
            "shoal_mocker_prefix_cache_hits_tokens",
            "Prompt tokens found in the prefix cache.",
            cache.hit_tokens,
        ),
        ("shoal_mocker_prompt_tokens", "Prompt tokens processed.", state.prompt_tokens),
        ("shoal_mocker_generation_tokens", "Tokens generated.", state.generation_tokens),
        (
            "shoal_mocker_cancelled_sequences",
            "Sequences ended by a client disconnect.",
            state.cancelled_sequences,
        ),
    )
    labels = [state.model]
    for name, doc, value in gauges:
        gauge = GaugeMetricFamily(name, doc, labels=["model"])
        gauge.add_metric(labels, value)
        yield gauge
    for name, doc, value in counters:
        counter = CounterMetricFamily(name, doc, labels=["model"])
        counter.add_metric(labels, value)
        yield counter
    requests = CounterMetricFamily(
        "shoal_mocker_requests", "Requests by kind.", labels=["model", "kind"]
    )
    for kind, n in state.requests.items():
        requests.add_metric([state.model, kind], n)
    yield requests
