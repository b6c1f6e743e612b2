"""The `kv` routing policy: send a prompt where its KV blocks are cached, by the engines' events.

Cost of an instance = (prompt blocks it does not hold) * `overlap_weight` + its load, the
load being its requests in flight times the set's average uncached blocks per request (the
prefill work a request in flight stands for, so both terms count blocks to compute); the cheapest wins, ties go to the least loaded, then round-robin. Tainted
and inhibited instances are never picked. A pick reads the index and does no I/O.

The prompt is tokenized as the worker will (`KvPrompt`, once per request and tokenizer). A
worker set without a usable tokenizer is routed by the `prefix` policy, with one log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from shoal.frontend.kv_prompt import PromptTokenizer
from shoal.frontend.kv_tracker import KvSet, KvTracker
from shoal.frontend.metadata import MetadataCache
from shoal.frontend.metrics import FrontendMetrics, Histogram
from shoal.frontend.registry import Registry, WorkerSet
from shoal.frontend.router import PrefixAware, Router
from shoal.frontend.upstream import Upstream
from shoal.kv import token_block_hashes

log = logging.getLogger(__name__)

OVERLAP_WEIGHT = 2.0
"""An uncached block costs two blocks of load: the load term counts a whole uncached prefill
for every request in flight, while most of them are past it, decoding."""
OVERLAP_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
PROMPT_CHARS = 8192  # what the prefix fallback reads of a prompt


class KvPrompt(str):
    """A request's prompt: its text (what the prefix fallback reads) and, per tokenizer,
    its token ids, computed on first use."""

    messages: list[Any] | None
    prompt: Any
    _tokens: tuple[PromptTokenizer | None, list[int] | None]

    @classmethod
    def of(cls, fields: Any) -> KvPrompt:
        messages = getattr(fields, "messages", None)
        prompt = getattr(fields, "prompt", None)
        if messages:
            text = "".join(
                f"{m.role}:{m.content if isinstance(m.content, str) else ''}\n" for m in messages
            )
        else:
            text = prompt if isinstance(prompt, str) else ""
        self = cls(text[:PROMPT_CHARS])
        self.messages = messages or None
        self.prompt = prompt
        self._tokens = (None, None)
        return self

    def tokens(self, tokenizer: PromptTokenizer) -> list[int] | None:
        if self._tokens[0] is tokenizer:
            return self._tokens[1]
        if self.messages is not None:
            ids = tokenizer.chat(self.messages)
        else:
            ids = tokenizer.completion(self.prompt) if self.prompt is not None else None
        self._tokens = (tokenizer, ids)
        return ids


class KvStatsView:
    """Per-pick figures for `/metrics`."""

    __slots__ = ("blocks", "matched", "overlap", "picks")

    def __init__(self) -> None:
        self.picks = 0
        self.blocks = 0
        self.matched = 0
        self.overlap = Histogram(OVERLAP_BUCKETS)


class KvRouter(Router):
    """The `kv` policy; `tracker` holds the indexes (fed by events) and tokenizers."""

    name = "kv"
    needs_prompt = True

    def __init__(self, *, overlap_weight: float = OVERLAP_WEIGHT, max_blocks: int = 1024) -> None:
        self.overlap_weight = overlap_weight
        self.max_blocks = max_blocks
        self.tracker = KvTracker()
        self.fallback = PrefixAware()
        self.figures = KvStatsView()
        self.prompt_of = KvPrompt.of

    def attach(self, registry: Registry, cache: MetadataCache, metrics: FrontendMetrics) -> None:
        """Follow `registry`'s instances, load tokenizers from `cache`, report on `metrics`."""
        self.tracker.cache = cache
        registry.observers.append(self.tracker)
        metrics.registry.register(KvCollector(self))

    async def close(self) -> None:
        await self.tracker.close()

    def pick(
        self, ws: WorkerSet, prompt: str | None = None, exclude: Collection[Upstream] = ()
    ) -> Upstream | None:
        state = self.tracker.sets.get(ws.id)
        if state is None or state.tokenizer is None:
            return self._fall_back(ws, state, prompt, exclude)
        tokens = prompt.tokens(state.tokenizer) if isinstance(prompt, KvPrompt) else None
        if tokens is None:
            return self._fall_back(ws, state, prompt, exclude)
        index = state.index
        hashes = token_block_hashes(tokens, index.block_size, limit=self.max_blocks)
        blocks = len(hashes)
        matched = index.overlaps(hashes) if blocks else {}
        now = time.monotonic()
        owner, depth = index.recent.matched(hashes, now)
        if depth > matched.get(owner, 0):
            matched[owner] = depth
        best = self._cheapest(ws, blocks, matched, state.avg_uncached_blocks, exclude)
        if best is not None:
            held = matched.get(best.instance_id, 0)
            state.avg_uncached_blocks += (max(blocks - held, 1) - state.avg_uncached_blocks) * 0.05
            index.recent.record(hashes, best.instance_id, now)
            self._count(blocks, held)
        return best

    def _cheapest(
        self,
        ws: WorkerSet,
        blocks: int,
        matched: dict[int, int],
        unit: float,
        exclude: Collection[Upstream],
    ) -> Upstream | None:
        """The instance of least cost; ties to the least loaded, then round-robin."""
        weight = self.overlap_weight
        targets = ws.routable
        n = len(targets)
        ws.cursor += 1
        best: Upstream | None = None
        best_key = (0.0, 0)
        for i in range(n):
            target = targets[(ws.cursor + i) % n]
            if target.inhibited or (exclude and target in exclude):
                continue
            cost = (blocks - matched.get(target.instance_id, 0)) * weight + target.in_flight * unit
            key = (cost, target.in_flight)
            if best is None or key < best_key:
                best, best_key = target, key
        return best

    def _count(self, blocks: int, matched: int) -> None:
        figures = self.figures
        figures.picks += 1
        figures.blocks += blocks
        figures.matched += matched
        figures.overlap.observe(matched / blocks if blocks else 0.0)

    def _fall_back(
        self, ws: WorkerSet, state: KvSet | None, prompt: str | None, exclude: Collection[Upstream]
    ) -> Upstream | None:
        if state is not None and not state.fallback_logged and state.no_tokenizer != "loading":
            state.fallback_logged = True
            log.info(
                "kv router: model %r (%s/%s) is routed by prefix: %s",
                ws.id.model,
                ws.id.namespace,
                ws.id.component,
                state.no_tokenizer,
            )
        return self.fallback.pick(ws, prompt, exclude)


class KvCollector(Collector):
    """The kv policy's figures on `/metrics`, read at scrape time."""

    def __init__(self, router: KvRouter) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        router = self.router
        stats = router.tracker.stats
        figures = router.figures
        yield CounterMetricFamily(
            "shoal_frontend_kv_events_applied",
            "KV cache events applied to the indexes.",
            value=stats.events,
        )
        yield CounterMetricFamily(
            "shoal_frontend_kv_batches_applied",
            "KV event batches applied, in sequence order.",
            value=stats.batches,
        )
        yield CounterMetricFamily(
            "shoal_frontend_kv_replays",
            "Replays asked of a worker to fill a gap or catch up.",
            value=stats.replays,
        )
        yield CounterMetricFamily(
            "shoal_frontend_kv_resnapshots",
            "Times an instance's blocks were dropped because events were lost for good.",
            value=stats.resnapshots,
        )
        yield CounterMetricFamily(
            "shoal_frontend_kv_decode_errors",
            "KV event messages that could not be read.",
            value=stats.decode_errors,
        )
        yield GaugeMetricFamily(
            "shoal_frontend_kv_index_blocks",
            "Blocks in the KV indexes, each (block, instance) counted once.",
            value=router.tracker.index_size(),
        )
        yield CounterMetricFamily(
            "shoal_frontend_kv_picks", "Requests routed by KV overlap.", value=figures.picks
        )
        yield CounterMetricFamily(
            "shoal_frontend_kv_prompt_blocks",
            "Prompt blocks of the requests routed by KV overlap.",
            value=figures.blocks,
        )
        yield CounterMetricFamily(
            "shoal_frontend_kv_predicted_cached_blocks",
            "Prompt blocks the index predicted cached on the chosen instance.",
            value=figures.matched,
        )
        overlap = HistogramMetricFamily(
            "shoal_frontend_kv_predicted_overlap_ratio",
            "Per request: the share of its prompt blocks predicted cached on the chosen instance.",
        )
        overlap.add_metric([], figures.overlap.buckets(), figures.overlap.sum)
        yield overlap
