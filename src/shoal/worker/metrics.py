"""`WorkerCollector`: a worker process's Prometheus metrics and its engines', per scrape.

The request path only bumps plain counters (`Endpoint.requests`, `in_flight`); the metric
families are built from them when `/metrics` is scraped, never per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shoal.discovery import EndpointId
from shoal.worker.endpoint import Endpoint
from shoal.worker.metadata import MetadataRegistry
from shoal.worker.registrations import Registrations


class WorkerCollector:
    """Builds `shoal_worker_*` metrics, and each engine's own labelled by endpoint, at a scrape."""

    def __init__(
        self,
        endpoints: Mapping[EndpointId, Endpoint],
        registrations: Registrations,
        metadata: MetadataRegistry,
        draining: asyncio.Event,
    ) -> None:
        self.endpoints = endpoints
        self.registrations = registrations
        self.metadata = metadata
        self.draining = draining

    def collect(self) -> Iterable[Metric]:
        requests = CounterMetricFamily(
            "shoal_worker_requests",
            "Requests served, by endpoint, route and status.",
            labels=["endpoint", "route", "status"],
        )
        in_flight = GaugeMetricFamily(
            "shoal_worker_requests_in_flight", "Requests being served.", labels=["endpoint"]
        )
        models = GaugeMetricFamily(
            "shoal_worker_models_attached", "Models announced in discovery.", labels=["endpoint"]
        )
        refused = GaugeMetricFamily(
            "shoal_worker_models_refused",
            "Models the engine lists that could not be announced (a bad card or file).",
            labels=["endpoint"],
        )
        engine_metrics: dict[str, Metric] = {}
        for ep in self.endpoints.values():
            name = str(ep.id)
            for (route, status), n in ep.requests.items():
                requests.add_metric([name, route, str(status)], n)
            in_flight.add_metric([name], ep.in_flight)
            models.add_metric([name], len(ep.models))
            refused.add_metric([name], len(ep.refused))
            if ep.engine is not None:
                _merge(engine_metrics, ep.engine.collect_metrics(), name)
        yield requests
        yield in_flight
        yield models
        yield refused
        yield from self._process_metrics()
        yield from engine_metrics.values()

    def _process_metrics(self) -> Iterable[Metric]:
        """The lease, the metadata files hosted and the drain: one value each."""
        yield GaugeMetricFamily(
            "shoal_worker_lease_held",
            "1 while the process lease is held with everything registered under it.",
            value=1 if self.registrations.lease_problem() is None else 0,
        )
        yield CounterMetricFamily(
            "shoal_worker_lease_grants",
            "Leases granted to this process (more than 1: the lease was lost and replaced).",
            value=self.registrations.grants,
        )
        yield CounterMetricFamily(
            "shoal_worker_registrations_repaired",
            "Keys of this process found missing from the store (deleted by someone else) and "
            "put back.",
            value=self.registrations.repairs,
        )
        yield GaugeMetricFamily(
            "shoal_worker_metadata_files", "Metadata files hosted.", value=len(self.metadata)
        )
        yield GaugeMetricFamily(
            "shoal_worker_draining", "1 while draining.", value=1 if self.draining.is_set() else 0
        )


def _merge(merged: dict[str, Metric], metrics: Iterable[Metric], endpoint: str) -> None:
    """Add an engine's `metrics` to `merged`, one family per name, labelled with `endpoint`."""
    for metric in metrics:
        family = merged.setdefault(
            metric.name, Metric(metric.name, metric.documentation, metric.type)
        )
        family.samples.extend(
            s._replace(labels={**s.labels, "endpoint": endpoint}) for s in metric.samples
        )
