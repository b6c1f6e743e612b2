"""The `kv` routing policy: send a prompt where its KV blocks are cached, by the engines' events.

Cost of an instance = (prompt blocks it does not hold) * `overlap_weight` + its load, the
load being its requests in flight times the set's average uncached blocks per request (the
prefill work a request in flight stands for, so both terms count blocks to compute); the cheapest wins, ties go to the least loaded, then round-robin. Tainted
and inhibited instances are never picked. A pick reads the index and does no I/O.

The prompt is tokenized as the worker will (`KvPrompt`, once per request and tokenizer). A
worker set without a usable tokenizer is routed by the `prefix` policy, with one log line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from shoal.frontend.http.upstream import Upstream
from shoal.frontend.kv.prompt import (
    RENDER_SECONDS,
    Deferred,
    NoRenderThread,
    PromptTokenizer,
    TemplateOverrun,
)
from shoal.frontend.kv.tracker import KvSet, KvTracker
from shoal.frontend.registry.metadata import MetadataCache
from shoal.frontend.registry.metrics import FrontendMetrics, Histogram
from shoal.frontend.registry.registry import Registry, WorkerSet
from shoal.frontend.registry.router import PrefixAware, Router, prefix_message
from shoal.kv import token_block_hashes

log = logging.getLogger(__name__)

OVERLAP_WEIGHT = 2.0
"""An uncached block costs two blocks of load: the load term counts a whole uncached prefill
for every request in flight, while most of them are past it, decoding."""
OVERLAP_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
PROMPT_CHARS = 8192  # what the prefix fallback reads of a prompt
INLINE_PROMPT = 2048  # a completion prompt this short is tokenized on the event loop
PREPARE_WAIT = 1.0  # seconds a request waits for its prompt's tokens, then routed by prefix


class KvPrompt(str):
    """A request's prompt: its text (what the prefix fallback reads) and, once `prepare`d
    for a tokenizer (off the event loop), its block hashes per block size."""

    messages: list[Any] | None
    prompt: Any
    hashes: dict[tuple[PromptTokenizer, int], list[int]]
    failure: str  # why the last preparation gave no hashes ("" when it did)

    @classmethod
    def of(cls, fields: Any) -> KvPrompt:
        messages = getattr(fields, "messages", None)
        prompt = getattr(fields, "prompt", None)
        if messages:
            lines: list[str] = []
            size = 0
            for message in messages:
                lines.append(line := _line(message))
                size += len(line)
                if size >= PROMPT_CHARS:
                    break
            text = "".join(lines)
        else:
            text = prompt[:PROMPT_CHARS] if isinstance(prompt, str) else ""
        self = cls(text[:PROMPT_CHARS])
        self.messages = messages or None
        self.prompt = prompt
        self.hashes = {}
        self.failure = ""
        return self

    @property
    def small(self) -> bool:
        """A completion prompt cheap enough to tokenize on the event loop (a chat never is:
        its template is a worker's code)."""
        prompt = self.prompt
        return (
            self.messages is None
            and isinstance(prompt, str | list)
            and len(prompt) <= INLINE_PROMPT
        )

    def tokens(self, tokenizer: PromptTokenizer, wanted: int | None = None) -> list[int] | None:
        """The prompt's token ids (the first `wanted` and then some, when given)."""
        if self.messages is not None:
            return tokenizer.chat(self.messages, wanted)
        return tokenizer.completion(self.prompt, wanted) if self.prompt is not None else None

    def prepare(
        self,
        tokenizer: PromptTokenizer,
        block_sizes: Iterable[int],
        max_blocks: int,
        *,
        inline: bool = False,
    ) -> None:
        """Tokenize (the start of) the prompt and hash its first `max_blocks` blocks for
        each of `block_sizes`. Runs in the tokenizer's thread, or on the event loop
        (`inline`: a chat then raises `Deferred` when it needs more work than the loop may do;
        a completion prompt is only prepared there when `small`)."""
        sizes = sorted(set(block_sizes))
        if self.messages is not None:
            hashes = tokenizer.chat_hashes(self.messages, sizes, max_blocks, inline=inline)
            if hashes is None:
                self.failure = "no chat template"
                return
            for size, block_hashes in hashes.items():
                self.hashes[(tokenizer, size)] = block_hashes
            return
        tokens = self.tokens(tokenizer, max_blocks * sizes[-1])
        if tokens is None:
            self.failure = "no text prompt"
            return
        for size in sizes:
            self.hashes[(tokenizer, size)] = token_block_hashes(tokens, size, limit=max_blocks)


def _line(message: Any) -> str:
    """A message as the prefix fallback reads it."""
    message = prefix_message(message, PROMPT_CHARS)
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    return f"{message.get('role')}:{content[:PROMPT_CHARS] if isinstance(content, str) else ''}\n"


class KvStatsView:
    """Per-pick figures for `/metrics`."""

    __slots__ = (
        "blocks",
        "deferred",
        "fallbacks",
        "matched",
        "no_thread",
        "overlap",
        "picks",
        "slow_prepares",
    )

    def __init__(self) -> None:
        self.picks = 0
        self.deferred = 0  # chats tried on the event loop, left to the tokenizer's thread
        self.fallbacks = 0  # requests routed by prefix as their prompt could not be tokenized
        self.slow_prepares = 0  # of them, because tokenizing took longer than PREPARE_WAIT
        self.no_thread = 0  # of them, because every render thread was busy (`RENDER_THREADS`)
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
        self.registry: Registry | None = None

    def attach(self, registry: Registry, cache: MetadataCache, metrics: FrontendMetrics) -> None:
        """Follow `registry`'s instances, load tokenizers from `cache`, report on `metrics`."""
        self.registry = registry
        self.tracker.cache = cache
        registry.observers.append(self.tracker)
        metrics.registry.register(KvCollector(self))

    async def close(self) -> None:
        await self.tracker.close()

    def describe(self) -> dict[str, Any]:
        """For `/health`: the models routed by prefix, and why."""
        by_prefix = {}
        for set_id, state in self.tracker.sets.items():
            tokenizer = state.tokenizer
            reason = state.no_tokenizer if tokenizer is None else tokenizer.disabled
            if reason and reason != "loading":
                by_prefix[f"{set_id.model} ({set_id.namespace}/{set_id.component})"] = reason
        described: dict[str, Any] = {
            "policy": self.name,
            "routed_by_prefix": by_prefix,
            "instances_over_block_cap": self.tracker.over_cap,
        }
        stream = self.tracker.stream
        if stream is not None:
            described["kv_events"] = stream.describe()
        return described

    def prepare(self, prompt: str | None, models: Iterable[str]) -> asyncio.Future[None] | None:
        """Tokenize and hash `prompt` for the tokenizers of `models`' worker sets, off the
        event loop: a future done when it is (or after `PREPARE_WAIT`, whatever is left
        then routed by prefix, and the work not started by then dropped: run for nobody, it
        held the set's thread and the chats queued behind it); None when nothing needs to
        wait. Never raises: a prompt
        that cannot be tokenized is routed by prefix, counted in `fallbacks`."""
        if not isinstance(prompt, KvPrompt) or self.registry is None:
            return None
        work: dict[PromptTokenizer, set[int]] = {}
        for name in models:
            model = self.registry.models.get(name)
            for ws in model.first_sets if model is not None else ():
                state = self.tracker.sets.get(ws.id)
                tokenizer = state.tokenizer if state is not None else None
                if tokenizer is not None and (prompt.messages is None or tokenizer.renders):
                    work.setdefault(tokenizer, set()).add(state.index.block_size)  # type: ignore[union-attr]
        if not work:
            return None
        if prompt.small or prompt.messages is not None:
            # A chat is tried on the event loop first, within tight bounds (`Deferred`
            # past them): a thread's hand-off costs more than most chats' tokenizing.
            work = {t: s for t, s in work.items() if not self._prepare_now(prompt, t, s)}
            if not work:
                return None
        return self._prepare_in_threads(prompt, work)

    def _prepare_now(self, prompt: KvPrompt, tokenizer: PromptTokenizer, sizes: set[int]) -> bool:
        """Prepare `prompt` for `tokenizer` on the event loop; False if it was deferred."""
        try:
            prompt.prepare(tokenizer, sizes, self.max_blocks, inline=True)
        except Deferred:
            self.figures.deferred += 1
            return False
        except Exception as exc:
            prompt.failure = f"{type(exc).__name__}: {exc}"
        return True

    def _prepare_in_threads(
        self, prompt: KvPrompt, work: dict[PromptTokenizer, set[int]]
    ) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        pending = set(work)

        def finished(tokenizer: PromptTokenizer, job: concurrent.futures.Future[None]) -> None:
            pending.discard(tokenizer)
            if not job.cancelled() and (exc := job.exception()) is not None:
                prompt.failure = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, NoRenderThread):  # (the system refused a thread)
                    self.figures.no_thread += 1
                if isinstance(exc, TemplateOverrun) and tokenizer.disabled:
                    log.warning("kv router: a chat template is disabled: %s", tokenizer.disabled)
            if not pending and not done.done():
                timer.cancel()
                done.set_result(None)

        def too_slow() -> None:
            for tokenizer in list(pending):
                jobs[tokenizer].cancel()  # (not started yet: nobody waits for it now)
                self._watch(tokenizer)
            if not done.done():
                self.figures.slow_prepares += 1
                done.set_result(None)

        timer = loop.call_later(PREPARE_WAIT, too_slow)
        jobs: dict[PromptTokenizer, concurrent.futures.Future[None]] = {}
        for tokenizer, sizes in work.items():
            report = functools.partial(finished, tokenizer)
            try:
                job = tokenizer.submit(prompt.prepare, tokenizer, sizes, self.max_blocks)
            except NoRenderThread as exc:  # `RENDER_THREADS` busy
                prompt.failure = str(exc)
                self.figures.no_thread += 1
                pending.discard(tokenizer)
                continue
            jobs[tokenizer] = job
            job.add_done_callback(functools.partial(_on_loop, loop, report))
        if not pending:
            timer.cancel()
            done.set_result(None)
        return done

    def _watch(self, tokenizer: PromptTokenizer) -> None:
        """Check, until it ends, the render running in `tokenizer`'s thread: one past its
        deadline is interrupted (`PromptTokenizer.overran`) and its template disabled."""
        if tokenizer.overran(time.monotonic()):
            log.warning("kv router: a chat template is disabled: %s", tokenizer.disabled)
        elif tokenizer.rendering and not tokenizer.watched:
            tokenizer.watched = True
            asyncio.get_running_loop().call_later(RENDER_SECONDS / 4, self._rewatch, tokenizer)

    def _rewatch(self, tokenizer: PromptTokenizer) -> None:
        tokenizer.watched = False
        self._watch(tokenizer)

    def pick(
        self, ws: WorkerSet, prompt: str | None = None, exclude: Collection[Upstream] = ()
    ) -> Upstream | None:
        state = self.tracker.sets.get(ws.id)
        if state is None or state.tokenizer is None:
            return self._fall_back(ws, state, prompt, exclude)
        index = state.index
        hashes = (
            prompt.hashes.get((state.tokenizer, index.block_size))
            if isinstance(prompt, KvPrompt)
            else None
        )
        if hashes is None:
            why = getattr(prompt, "failure", "") or "not tokenized"
            log.debug("kv router: a prompt routed by prefix: %s", why)
            self.figures.fallbacks += 1
            return self.fallback.pick(ws, prompt, exclude)
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


def _on_loop(loop: asyncio.AbstractEventLoop, report: Callable[[Any], None], job: Any) -> None:
    """Call `report(job)` on `loop` (from the tokenizer's thread); not once it is closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(report, job)


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
        yield CounterMetricFamily(
            "shoal_frontend_kv_stream_drops",
            "Records of the relay's stream nats-py dropped (its queue full), read again.",
            value=stats.stream_drops,
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
            "shoal_frontend_kv_prefix_fallbacks",
            "Picks routed by prefix because the prompt could not be tokenized (template "
            "error or overrun, tokenizing failed or took too long).",
            value=figures.fallbacks,
        )
        yield CounterMetricFamily(
            "shoal_frontend_kv_deferred_prompts",
            "Chats too large or slow to render and tokenize on the event loop, prepared in "
            "the tokenizer's thread.",
            value=figures.deferred,
        )
        yield CounterMetricFamily(
            "shoal_frontend_kv_slow_prompts",
            "Requests whose prompt was not tokenized within the wait, routed by prefix.",
            value=figures.slow_prepares,
        )
        yield CounterMetricFamily(
            "shoal_frontend_kv_no_render_thread",
            "Chats left to a thread that found none free (all busy, or the system refused "
            "one), routed by prefix.",
            value=figures.no_thread,
        )
        yield CounterMetricFamily(
            "shoal_frontend_kv_over_block_cap",
            "Times an instance held more blocks than the per-instance cap and was resnapshotted.",
            value=sum(router.tracker.over_cap.values()),
        )
        tokenizers = {s.tokenizer for s in router.tracker.sets.values() if s.tokenizer is not None}
        yield GaugeMetricFamily(
            "shoal_frontend_kv_piece_cache_bytes",
            "Bytes held by the caches of tokenized and hashed segments of chat prompts.",
            value=sum(c.bytes for c in {t.chain for t in tokenizers if t.chain is not None}),
        )
        yield GaugeMetricFamily(
            "shoal_frontend_kv_disabled_templates",
            "Chat templates disabled for overrunning their time or size budget.",
            value=sum(1 for t in tokenizers if t.disabled),
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
