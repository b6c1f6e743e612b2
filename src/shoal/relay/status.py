"""The relay's probes: `/live`, `/health`, `/v1/membership/status`, `/v1/membership` and
`/metrics`.

`/live` answers 200 while the process runs (the liveness probe: a NATS or store outage is
not fixed by a restart). `/health` answers 200 while the membership has a selection in force
and NATS takes records, 503 naming why otherwise (the relay keeps following its workers
meanwhile): a report to alert on, not a probe.

It is served as a worker's status server is (`shoal.worker.http_server`): at most
`STATUS_MAX_CONNECTIONS` connections, heads, bodies, unread answers and idle keep-alive timed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shoal.membership import MembershipWatch
from shoal.relay.member import MemberKey
from shoal.relay.relay import STATUS_MEMBERS, KvRelay, parse_member_cursor
from shoal.worker.http_server import STATUS_MAX_CONNECTIONS, STATUS_SEND_TIMEOUT, start_server


class StatusServer:
    """Serves the relay's and its membership watch's status; holds those two only."""

    def __init__(self, relay: KvRelay, membership: MembershipWatch) -> None:
        self.relay = relay
        self.membership = membership
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        app = web.Application()
        app.router.add_get("/live", self.get_live)
        app.router.add_get("/health", self.get_health)
        app.router.add_get("/v1/membership/status", self.get_status)
        app.router.add_get("/v1/membership", self.get_membership)
        app.router.add_get("/metrics", self.get_metrics)
        runner = await start_server(
            app,
            host,
            port,
            max_connections=STATUS_MAX_CONNECTIONS,
            send_timeout=STATUS_SEND_TIMEOUT,
            access_log=None,
        )
        self._runner = runner
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.url = f"http://{shown}:{runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def health(self) -> tuple[int, dict[str, Any]]:
        reasons: dict[str, str] = {}
        status = self.membership.status
        if status.applied_revision is None and status.last_error:
            reasons["membership"] = status.last_error
        if not self.relay.connected.is_set():
            reasons["nats"] = self.relay.nats_error or self.relay.nats_state
        elif self.relay.refusing is not None:
            reasons["nats"] = self.relay.refusing
        body: dict[str, Any] = {"status": "unavailable" if reasons else "ok"}
        if reasons:
            body["unhealthy"] = reasons
        return (503 if reasons else 200), body

    async def get_live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def get_health(self, request: web.Request) -> web.Response:
        code, body = self.health()
        return web.json_response(body, status=code)

    async def get_status(self, request: web.Request) -> web.Response:
        """`?limit=N` (1 to 1,000, the default) members after `?after=namespace/instance_id`."""
        query = request.query
        text = query.get("limit", str(STATUS_MEMBERS))
        plain = text.isascii() and text.isdigit() and len(text) <= 6  # ("²", 5,000 digits)
        if not plain or not 1 <= int(text) <= STATUS_MEMBERS:
            return _invalid("limit", f"limit: {text[:20]!r} is not within 1 and {STATUS_MEMBERS}")
        try:
            after = parse_member_cursor(query["after"]) if "after" in query else None
        except ValueError as exc:
            return _invalid("after", str(exc))
        relay = self.relay.status(int(text), after)
        return web.json_response({**self.membership.status.to_dict(), **relay})

    async def get_membership(self, request: web.Request) -> web.Response:
        body = await self.membership.view.json()
        return web.Response(body=body, content_type="application/json")

    async def get_metrics(self, request: web.Request) -> web.Response:
        # The figures are read here, on the event loop; rendered in a thread (a lag per
        # member: 10,000 members took ~90 ms).
        body = await asyncio.to_thread(_render, _Figures.of(self.relay))
        return web.Response(body=body, content_type="text/plain", charset="utf-8")


@dataclass(frozen=True)
class _Figures:
    """The relay's figures at one moment, for `/metrics`."""

    counters: tuple[tuple[str, str, float], ...]
    members: int
    queued_bytes: int
    flying_bytes: int
    taking: bool
    lag: Mapping[MemberKey, float]

    @classmethod
    def of(cls, relay: KvRelay) -> _Figures:
        stats = relay.stats
        subs = stats.subscriptions
        counters = (
            ("batches_relayed", "batches the stream stored", stats.relayed),
            ("duplicates", "records the stream refused as already stored", stats.duplicates),
            (
                "dropped_batches",
                "batches dropped (over NATS's max payload, a queue past its bound)",
                stats.dropped,
            ),
            ("resnapshots", "resnapshot records published or queued", stats.resnapshots),
            ("publish_errors", "publishes that failed (retried)", stats.publish_errors),
            (
                "answers_dropped",
                "acknowledgements nats-py dropped, its queue full (records sent again)",
                stats.answers_dropped,
            ),
            ("replays", "replays asked of workers", subs.replays),
            ("batches_received", "batches read from workers", subs.batches),
            ("decode_errors", "worker messages that could not be read", subs.decode_errors),
        )
        return cls(
            counters,
            len(relay.members),
            stats.queued_bytes,
            stats.flying,
            relay.taking,
            relay.lag(),
        )


def _render(figures: _Figures) -> bytes:
    registry = CollectorRegistry()
    registry.register(_RelayCollector(figures))
    return generate_latest(registry)


class _RelayCollector(Collector):
    def __init__(self, figures: _Figures) -> None:
        self.figures = figures

    def collect(self) -> Iterator[Metric]:
        figures = self.figures
        for name, doc, value in figures.counters:
            yield CounterMetricFamily(f"shoal_relay_{name}", doc, value=value)
        yield GaugeMetricFamily("shoal_relay_members", "instances followed", value=figures.members)
        yield GaugeMetricFamily(
            "shoal_relay_queued_bytes",
            "payload bytes queued for NATS by every member (bounded: buffer_bytes)",
            value=figures.queued_bytes,
        )
        yield GaugeMetricFamily(
            "shoal_relay_inflight_bytes",
            "payload bytes sent to NATS and not acknowledged yet (bounded: inflight_bytes)",
            value=figures.flying_bytes,
        )
        yield GaugeMetricFamily(
            "shoal_relay_connected", "1 while NATS takes records", value=figures.taking
        )
        lag = GaugeMetricFamily(
            "shoal_relay_lag_ms",
            "ms from a worker's batch timestamp to the stream's acknowledgement, per member",
            labels=["namespace", "instance"],
        )
        for (namespace, instance_id), ms in figures.lag.items():
            lag.add_metric([namespace, f"{instance_id:x}"], ms)
        yield lag


def _invalid(param: str, message: str) -> web.Response:
    """A 400 in the OpenAI error format, naming the query parameter."""
    error = {"message": message, "type": "invalid_request_error", "param": param,
             "code": "invalid_value"}  # fmt: skip
    return web.json_response({"error": error}, status=400)
