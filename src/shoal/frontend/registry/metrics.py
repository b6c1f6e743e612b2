"""Prometheus metrics of one frontend, in a `CollectorRegistry` of its own.

Request metrics are plain counters kept per model (`ModelStats`) and turned into Prometheus
families only when `/metrics` is scraped: the request path pays a dict increment, not a
lock and a label lookup (and one more into the process-wide `Totals` the dashboard charts). Control-plane metrics (reconciliation) are ordinary
`prometheus_client` counters and a histogram: they change a few times a minute. Refused
cards are counted per model name too (`card_refused`), written with the per-model series:
a rolling upgrade or hostile workers may have thousands of them refused.

The per-model series are written as text by `_PerModel`, not through `prometheus_client`'s
families (the same text, tested against it): a fleet of 10,000 models with traffic has
380,000 of those lines, which `generate_latest` took 2.1 s to write, in one piece. `render`
writes them at about a third of that cost, and `render_sliced` a `RENDER_SLICE` of models at a
time with the event loop served in between (2,000 refused cards written in one piece held it
97 ms): a scrape never holds up the requests. Its other work over every model is sliced too:
the names are sorted a `SORT_SLICE` at a time (`sorted_in_steps`), each model's live instances
counted when its line is written (`live_instances` is a mapping that counts when read), and
the departed found a `SORT_SLICE` of names at a time.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import Histogram as PromHistogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString as _go_float

from shoal.discovery.join import IGNORED_CHANGES
from shoal.discovery.values import MALFORMED
from shoal.frontend.registry.metadata import MetadataCache
from shoal.frontend.registry.names import SORT_SLICE, live_names, sorted_in_steps

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)  # fmt: skip

LAG_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LAG_INTERVAL = 0.025  # seconds between two samples of the event loop's lag
SPLICE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
UNKNOWN_MODEL = "_unknown"  # the label of requests for models we do not serve
DEPARTED_TTL = 600.0
"""Seconds the series of a model that left the registry are still shown, then dropped."""
_fmt: Callable[[float], str] = _go_float  # (untyped there) a value as `generate_latest` writes it

RENDER_SLICE = 128
"""Models whose series `render_sliced` writes between two yields to the event loop (about
40 lines each with traffic: a few milliseconds), or whose live instances it counts (a virtual
model's are a set over its targets' instances)."""


class Histogram:
    """A histogram without locks: bucket counts and a sum, cumulated when scraped."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
        return out


class Totals:
    """Every model's requests by HTTP status and TTFT bucket counts, for the whole process:
    bumped with the per-model counters (a dict increment, a list increment), never
    decreased (a departed model's series dropped from `/metrics` stay counted here), so the
    dashboard's 2-s sample reads ~20 numbers instead of walking every model."""

    __slots__ = ("requests", "ttft")

    def __init__(self) -> None:
        self.requests: dict[int, int] = {}  # HTTP status -> count
        self.ttft = [0] * (len(TTFT_BUCKETS) + 1)  # per bucket, as `Histogram.counts`


class _CountedHistogram(Histogram):
    """A histogram whose observations are also counted in `total` (`Totals.ttft`)."""

    __slots__ = ("total",)

    def __init__(self, bounds: Sequence[float], total: list[int]) -> None:
        super().__init__(bounds)
        self.total = total

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        self.counts[i] += 1
        self.total[i] += 1
        self.sum += value


class ModelStats:
    """The request counters of one model name (counted in `totals` too)."""

    __slots__ = ("duration", "in_flight", "requests", "retries", "totals", "ttft")

    def __init__(self, totals: Totals | None = None) -> None:
        self.totals = Totals() if totals is None else totals
        self.requests: dict[int, int] = {}  # HTTP status -> count
        self.in_flight = 0
        self.retries = 0
        self.ttft: Histogram = _CountedHistogram(TTFT_BUCKETS, self.totals.ttft)
        self.duration = Histogram(DURATION_BUCKETS)

    def count(self, status: int) -> None:
        self.requests[status] = self.requests.get(status, 0) + 1
        totals = self.totals.requests
        totals[status] = totals.get(status, 0) + 1


class FrontendMetrics:
    """Everything `/metrics` shows for one frontend.

    `live_instances` gives the models live now, each with its live instances: a mapping
    whose counts are read when their lines are written (the frontend's counts each when
    read). The series of a model it no longer names are kept `departed_ttl` seconds, then
    dropped (its request series and its `cards_refused` one, requested here or not), so
    departed models (adapters come and go) do not grow `/metrics` for ever; a model with
    requests in flight is never dropped.
    """

    def __init__(
        self, *, departed_ttl: float = DEPARTED_TTL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.models: dict[str, ModelStats] = {}
        self.totals = Totals()  # every model's, departed ones' too (the dashboard's charts)
        self.live_instances: Callable[[], Mapping[str, int]] = dict
        self.departed_ttl = departed_ttl
        self.clock = clock
        self._departed: dict[str, float] = {}  # model name -> when it was first seen gone
        # True while `render` writes the registry: the per-model series are its own text.
        self.rendering = False
        self.refused: dict[str, int] = {}  # model name -> its cards refused (`card_refused`)
        self.registry.register(_RequestCollector(self))
        self.registry.register(_DiscoveryCollector())
        self.reconcile_runs = Counter(
            "shoal_frontend_reconcile_runs",
            "Reconciliation passes that listed discovery and compared it with the registry.",
            registry=self.registry,
        )
        self.reconcile_duration = PromHistogram(
            "shoal_frontend_reconcile_duration_seconds",
            "Wall time of one reconciliation pass: list discovery and repair (the metadata "
            "fetches it starts run on after it).",
            buckets=RECONCILE_BUCKETS,
            registry=self.registry,
        )
        self.reconcile_repairs = Counter(
            "shoal_frontend_reconcile_repairs",
            "Differences between discovery and the registry that a reconciliation pass repaired.",
            ["action"],
            registry=self.registry,
        )
        self.reconcile_failures = Counter(
            "shoal_frontend_reconcile_failures",
            "Reconciliation passes or entries that failed (retried on the next pass).",
            ["stage"],
            registry=self.registry,
        )
        self.metadata_fetch_failures = Counter(
            "shoal_frontend_metadata_fetch_failures",
            "Fetches of a card's metadata files that failed or did not match their checksum.",
            registry=self.registry,
        )
        self.instances_inhibited = Counter(
            "shoal_frontend_instances_inhibited",
            "Times an instance was taken out of routing after a failure.",
            registry=self.registry,
        )
        self.migrations = Counter(
            "shoal_frontend_migrations",
            "Streams whose instance failed after the first token: a continuation sent to "
            "another instance (outcome attempted; reason: lost, eof, idle_timeout), a migrated "
            "stream that completed (succeeded), one with no tokens left ended by the gateway "
            "(ended), or a stream ended with an error event (refused; reason: why it could not "
            "migrate).",
            ["outcome", "reason"],
            registry=self.registry,
        )
        self.migration_splice = PromHistogram(
            "shoal_frontend_migration_splice_seconds",
            "From a migrated stream's failure to the continuation's first event written to the "
            "client: the gap the client sees, beyond detecting the failure.",
            buckets=SPLICE_BUCKETS,
            registry=self.registry,
        )

        self.loop_lag = PromHistogram(
            "shoal_frontend_event_loop_lag_seconds",
            f"How late the event loop ran a timer due every {LAG_INTERVAL:g} s: a callback that "
            "held the loop this long delayed every request and answer of this process.",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )

    async def sample_loop_lag(self, interval: float = LAG_INTERVAL) -> None:
        """Observe `loop_lag` every `interval` s, for ever (a hold longer than `interval`
        is always seen; a shorter one with a chance of its length over `interval`)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            self.loop_lag.observe(max(0.0, loop.time() - due))

    def watch_metadata_cache(self, cache: MetadataCache) -> None:
        """Show `cache`'s size and write errors on `/metrics`."""
        self.registry.register(_MetadataCacheCollector(cache))

    def watch_store(self, unreachable_since: Callable[[], float | None]) -> None:
        """Show whether the store answers: `unreachable_since` gives the wall-clock time of
        the first failed call of the current outage, or None while it answers."""
        self.registry.register(_StoreCollector(unreachable_since))

    def model(self, name: str) -> ModelStats:
        stats = self.models.get(name)
        if stats is None:
            stats = self.models[name] = ModelStats(self.totals)
        return stats

    def card_refused(self, name: str) -> None:
        """Count a card of model `name` refused (`shoal_frontend_cards_refused_total`)."""
        self.refused[name] = self.refused.get(name, 0) + 1

    def render(self) -> bytes:
        """The `/metrics` text, in one piece (`render_sliced` on the event loop)."""
        text = _PerModel()
        for _ in self._render_per_model(text):
            pass
        return text.render(self._rest())

    async def render_sliced(self) -> list[bytes]:
        """`render` in pieces (written as they are, never joined: 30 MB at 10,000 models
        with traffic), yielding to the event loop after each `RENDER_SLICE` of models. Each
        model's series are read as they are when its slice is written (counters only grow:
        a scrape mid-way through a burst shows some models a little later than others)."""
        text = _PerModel()
        for _ in self._render_per_model(text):
            await asyncio.sleep(0)
        return text.pieces_after(self._rest())

    def _rest(self) -> bytes:
        """Everything registered (any layer's collectors too) but the per-model series."""
        self.rendering = True
        try:
            return generate_latest(self.registry)
        finally:
            self.rendering = False

    def _render_per_model(self, text: _PerModel) -> Iterator[None]:
        """Write the per-model series into `text`; a step per slice of models. A model
        dropped or gone while earlier slices were written is left out of its family."""
        present = self.live_instances()
        yield from self._dropping(present)
        models = self.models
        names = yield from sorted_in_steps(list(models))
        for start in range(0, len(names), RENDER_SLICE):
            chosen = names[start : start + RENDER_SLICE]
            text.add_stats([(n, s) for n in chosen if (s := models.get(n)) is not None])
            yield
        live = yield from sorted_in_steps(live_names(present))
        for start in range(0, len(live), RENDER_SLICE):
            chosen = live[start : start + RENDER_SLICE]
            text.add_counts(-2, [(n, c) for n in chosen if (c := present.get(n)) is not None])
            yield
        # (one line per model, in the order they were first refused)
        refused = list(self.refused.items())
        for start in range(0, len(refused), SORT_SLICE):
            text.add_counts(-1, refused[start : start + SORT_SLICE])
            yield

    def drop_departed(self, present: Mapping[str, int] | None = None) -> None:
        """Drop the series of models gone from the registry for longer than `departed_ttl`
        (`present`: the models live now, by their `live_instances`, when already known), in
        one piece (`drop_departed_sliced` on the event loop)."""
        for _ in self._dropping(self.live_instances() if present is None else present):
            pass

    async def drop_departed_sliced(self) -> None:
        """`drop_departed`, yielding to the event loop after each `SORT_SLICE` of names."""
        for _ in self._dropping(self.live_instances()):
            await asyncio.sleep(0)

    def _dropping(self, present: Mapping[str, int]) -> Iterator[None]:
        """`drop_departed`'s work, a step per `SORT_SLICE` names (a name only: no count of
        live instances is read)."""
        now, step = self.clock(), SORT_SLICE
        departed, models, refused = self._departed, self.models, self.refused
        back = list(departed)
        for start in range(0, len(back), step):
            for name in back[start : start + step]:
                if name in present:
                    departed.pop(name, None)
            yield
        # The newly gone (the others are dated); a model with a refused card may have had no
        # request here: no `ModelStats`.
        names = list(models) + list(refused)
        for start in range(0, len(names), step):
            for name in names[start : start + step]:
                if (
                    name not in departed
                    and name != UNKNOWN_MODEL
                    and (name in models or name in refused)
                    and name not in present
                ):
                    departed[name] = now
            yield
        gone = list(departed.items())  # (in the order they left: the expired first)
        for start in range(0, len(gone), step):
            for name, since in gone[start : start + step]:
                if now - since <= self.departed_ttl:
                    return
                stats = models.get(name)
                if departed.get(name) == since and (stats is None or not stats.in_flight):
                    if name not in present:  # (not back since it was last seen gone)
                        models.pop(name, None)
                        refused.pop(name, None)
                    del departed[name]
            yield


class _RequestCollector(Collector):
    """Turns the per-model counters into Prometheus families at scrape time."""

    def __init__(self, metrics: FrontendMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        if self.metrics.rendering:
            return  # (`render` writes these as text itself)
        requests = CounterMetricFamily(
            "shoal_frontend_requests",
            "Requests answered, by model and HTTP status.",
            labels=["model", "status"],
        )
        in_flight = GaugeMetricFamily(
            "shoal_frontend_inflight_requests",
            "Requests being answered now, by model.",
            labels=["model"],
        )
        retries = CounterMetricFamily(
            "shoal_frontend_retries",
            "Requests sent again to another instance after a failure before the first byte.",
            labels=["model"],
        )
        ttft = HistogramMetricFamily(
            "shoal_frontend_time_to_first_token_seconds",
            "Time from receiving a streaming request to forwarding its first body byte.",
            labels=["model"],
        )
        duration = HistogramMetricFamily(
            "shoal_frontend_request_duration_seconds",
            "Time from receiving a request to the end of its response.",
            labels=["model"],
        )
        self.metrics.drop_departed()
        for name, stats in sorted(self.metrics.models.items()):
            for status, count in sorted(stats.requests.items()):
                requests.add_metric([name, str(status)], count)
            in_flight.add_metric([name], stats.in_flight)
            retries.add_metric([name], stats.retries)
            ttft.add_metric([name], stats.ttft.buckets(), stats.ttft.sum)
            duration.add_metric([name], stats.duration.buckets(), stats.duration.sum)
        live = GaugeMetricFamily(
            "shoal_frontend_live_instances",
            "Instances that can take requests (joined, untainted), by model.",
            labels=["model"],
        )
        for name, count in sorted(self.metrics.live_instances().items()):
            live.add_metric([name], count)
        refused = CounterMetricFamily(
            "shoal_frontend_cards_refused",
            "Model cards refused because their checksum differs from their worker set's.",
            labels=["model"],
        )
        for name, count in sorted(self.metrics.refused.items()):
            refused.add_metric([name], count)
        yield from (requests, in_flight, retries, ttft, duration, live, refused)


_LABEL_ESCAPES = str.maketrans({"\\": r"\\", "\n": r"\n", '"': r"\""})
_HELP_ESCAPES = str.maketrans({"\\": r"\\", "\n": r"\n"})

# The per-model families as `_RequestCollector` declares them: (name, type, help).
_FAMILIES = (
    ("shoal_frontend_requests_total", "counter", "Requests answered, by model and HTTP status."),
    ("shoal_frontend_inflight_requests", "gauge", "Requests being answered now, by model."),
    (
        "shoal_frontend_retries_total",
        "counter",
        "Requests sent again to another instance after a failure before the first byte.",
    ),
    (
        "shoal_frontend_time_to_first_token_seconds",
        "histogram",
        "Time from receiving a streaming request to forwarding its first body byte.",
    ),
    (
        "shoal_frontend_request_duration_seconds",
        "histogram",
        "Time from receiving a request to the end of its response.",
    ),
    (
        "shoal_frontend_live_instances",
        "gauge",
        "Instances that can take requests (joined, untainted), by model.",
    ),
    (
        "shoal_frontend_cards_refused_total",
        "counter",
        "Model cards refused because their checksum differs from their worker set's.",
    ),
)


class _PerModel:
    """The per-model series as Prometheus text, written a slice of models at a time: the
    lines of each family gathered apart, as the format wants each family in one piece, and
    each line as `generate_latest` writes it (labels in name order, values as Go floats)."""

    def __init__(self) -> None:
        # Per family, its text so far: a slice's lines encoded as one piece (the last step
        # then joins a few hundred pieces, not 400,000 lines).
        self.pieces: list[list[bytes]] = [[] for _ in _FAMILIES]

    def add_stats(self, models: Sequence[tuple[str, ModelStats]]) -> None:
        lines: list[list[str]] = [[] for _ in _FAMILIES]
        requests, in_flight, retries, ttft, duration, _, _ = lines
        fmt = _fmt
        for name, stats in models:
            model = 'model="' + name.translate(_LABEL_ESCAPES) + '"'
            for status, count in sorted(stats.requests.items()):
                requests.append(
                    f'shoal_frontend_requests_total{{{model},status="{status}"}} {fmt(count)}\n'
                )
            in_flight.append(
                f"shoal_frontend_inflight_requests{{{model}}} {fmt(stats.in_flight)}\n"
            )
            retries.append(f"shoal_frontend_retries_total{{{model}}} {fmt(stats.retries)}\n")
            for into, family, histogram in (
                (ttft, "shoal_frontend_time_to_first_token_seconds", stats.ttft),
                (duration, "shoal_frontend_request_duration_seconds", stats.duration),
            ):
                buckets = histogram.buckets()
                into.extend(
                    f'{family}_bucket{{le="{le}",{model}}} {fmt(value)}\n' for le, value in buckets
                )
                into.append(f"{family}_count{{{model}}} {fmt(buckets[-1][1])}\n")
                into.append(f"{family}_sum{{{model}}} {fmt(histogram.sum)}\n")
        self._keep(lines)

    def add_counts(self, family: int, counts: Sequence[tuple[str, int]]) -> None:
        """The lines of a family of one number per model (`_FAMILIES[family]`)."""
        fmt, name = _fmt, _FAMILIES[family][0]
        lines: list[list[str]] = [[] for _ in _FAMILIES]
        lines[family].extend(
            f'{name}{{model="{model.translate(_LABEL_ESCAPES)}"}} {fmt(n)}\n' for model, n in counts
        )
        self._keep(lines)

    def _keep(self, lines: list[list[str]]) -> None:
        for pieces, family in zip(self.pieces, lines, strict=True):
            if family:
                pieces.append("".join(family).encode())

    def render(self, before: bytes = b"") -> bytes:
        """The text, after `before` (one copy of it all: 30 MB at 10,000 models)."""
        return b"".join(self.pieces_after(before))

    def pieces_after(self, before: bytes) -> list[bytes]:
        """The text after `before`, in the pieces it was written in."""
        parts: list[bytes] = [before]
        for (name, kind, help_text), pieces in zip(_FAMILIES, self.pieces, strict=True):
            parts.append(f"# HELP {name} {help_text.translate(_HELP_ESCAPES)}\n".encode())
            parts.append(f"# TYPE {name} {kind}\n".encode())
            parts.extend(pieces)
        return parts


class _MetadataCacheCollector(Collector):
    """The metadata cache's size, downloads and trouble, read at scrape time."""

    def __init__(self, cache: MetadataCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        cache = self.cache
        status = cache.status()
        yield GaugeMetricFamily(
            "shoal_frontend_metadata_cache_bytes",
            "Bytes of verified metadata files in the cache directory.",
            value=status["bytes"],
        )
        yield GaugeMetricFamily(
            "shoal_frontend_metadata_cache_files",
            "Verified metadata files in the cache directory.",
            value=status["files"],
        )
        yield GaugeMetricFamily(
            "shoal_frontend_metadata_uncached_files",
            "Verified metadata files used without being cached because the disk refused them.",
            value=status["uncached_files"],
        )
        yield CounterMetricFamily(
            "shoal_frontend_metadata_downloads",
            "Metadata file downloads started (one per file, shared by every card needing it).",
            value=cache.downloads,
        )
        yield CounterMetricFamily(
            "shoal_frontend_metadata_cache_errors",
            "Writes to the metadata cache that the disk refused (unwritable, full).",
            value=cache.errors,
        )
        yield CounterMetricFamily(
            "shoal_frontend_metadata_cache_evictions",
            "Metadata files removed from the cache to keep it within its size.",
            value=cache.evictions,
        )


class _StoreCollector(Collector):
    """The store's reachability, read at scrape time (an outage every replica sees: alert on
    it, it fails no readiness probe)."""

    def __init__(self, unreachable_since: Callable[[], float | None]) -> None:
        self.unreachable_since = unreachable_since

    def collect(self) -> Iterator[Metric]:
        since = self.unreachable_since()
        yield GaugeMetricFamily(
            "shoal_frontend_store_reachable",
            "1 while the store answered the frontend's last call, 0 during an outage.",
            value=1.0 if since is None else 0.0,
        )
        yield GaugeMetricFamily(
            "shoal_frontend_store_unreachable_seconds",
            "Seconds since the store's current outage began (0 while it answers).",
            value=0.0 if since is None else max(0.0, time.time() - since),
        )


class _DiscoveryCollector(Collector):
    """Discovery's counters of values it skipped (malformed) or changes it ignored.

    Discovery keeps them in the process-wide Prometheus registry, which a frontend does not
    render: they are shown on its own `/metrics` too, counted for the whole process.
    """

    def collect(self) -> Iterator[Metric]:
        yield from MALFORMED.collect()
        yield from IGNORED_CHANGES.collect()
