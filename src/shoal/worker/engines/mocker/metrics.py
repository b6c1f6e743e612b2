"""The mocker's Prometheus metrics: its slots, queue, simulated KV cache and token counts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shoal.worker.engines.mocker.kv_transfer import HeldBlocks
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
    computed_prompt_tokens: int
    remote_prefills: int
    remote_decodes: int
    kv_received_blocks: int
    kv_fetch_seconds: float
    held: HeldBlocks


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
            "shoal_mocker_computed_prompt_tokens",
            "Prompt tokens prefilled here: neither cached nor handed over by a remote prefill.",
            state.computed_prompt_tokens,
        ),
        (
            "shoal_mocker_remote_prefills",
            "Requests prefilled here for a remote decode (kv_transfer_params.do_remote_decode).",
            state.remote_prefills,
        ),
        (
            "shoal_mocker_remote_decodes",
            "Requests decoded here from a remote prefill's blocks.",
            state.remote_decodes,
        ),
        (
            "shoal_mocker_kv_received_blocks",
            "KV blocks fetched from remote prefills.",
            state.kv_received_blocks,
        ),
        (
            "shoal_mocker_kv_fetch_seconds",
            "Time remote decodes waited for their KV blocks (the handoff), summed; "
            "divide by shoal_mocker_remote_decodes_total for the mean.",
            state.kv_fetch_seconds,
        ),
        (
            "shoal_mocker_kv_sent_blocks",
            "KV blocks fetched by remote decodes from this prefill.",
            state.held.served_blocks,
        ),
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
