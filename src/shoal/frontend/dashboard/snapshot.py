"""What the `/ui` dashboard shows: a JSON-able read of one frontend, and its request history.

`FleetReader.read()` walks the registry, the watcher's registrations, the control loops and
the membership through their public attributes and returns `Sections`: each section is a
mapping from a stable key to one JSON-encoded item, so that two reads can be diffed item by
item (`diff`) and a page of 1,000 instances receives only the rows that changed.

`RequestHistory` is the ring buffer behind the page's charts: every `period` seconds it turns
the per-model request counters of `FrontendMetrics` into one point (requests/s, client and
server errors/s, TTFT percentiles of that period). It reads counters the request path keeps
anyway, so the request path pays nothing for it.

Neither runs on the request path: the dashboard's timer calls them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from shoal import __version__
from shoal.controllers import ControllerManager
from shoal.frontend.http.upstream import Upstream
from shoal.frontend.registry.metrics import TTFT_BUCKETS, FrontendMetrics
from shoal.frontend.registry.registry import Registry
from shoal.frontend.registry.watcher import ModelWatcher
from shoal.urls import redact_url


class FleetConfig(Protocol):
    """The settings the dashboard shows (`FrontendConfig` has them)."""

    @property
    def router(self) -> str: ...
    @property
    def namespaces(self) -> tuple[str, ...]: ...
    @property
    def api_keys(self) -> tuple[str, ...]: ...
    @property
    def auth(self) -> str: ...
    @property
    def tls_certfile(self) -> Path | None: ...


class Fleet(Protocol):
    """What the dashboard reads of one frontend. `shoal.frontend.app.Frontend` is one; the
    dashboard does not import it (the app owns the dashboard, not the other way round)."""

    @property
    def config(self) -> FleetConfig: ...
    @property
    def metrics(self) -> FrontendMetrics: ...
    @property
    def manager(self) -> ControllerManager: ...
    @property
    def membership(self) -> Any: ...
    @property
    def registry(self) -> Registry: ...
    @property
    def watcher(self) -> ModelWatcher | None: ...
    @property
    def draining(self) -> bool: ...
    @property
    def started_at(self) -> float: ...


DRAINING = "draining"  # the taint a worker sets while it drains
ERROR_WINDOW = 300.0  # seconds of failures counted as an instance's "recent errors"
KEYED = ("models", "instances", "incomplete", "routes")  # sections diffed item by item
WHOLE = ("frontend", "membership", "loops")  # small sections sent whole when they change

_encode = msgspec.json.encode

Sections = dict[str, dict[str, bytes]]
"""Section name -> item key -> the item as JSON. A whole section has the single key ``""``."""

RoutesSource = Callable[[], Iterable[Mapping[str, Any]]]
"""The virtual models and providers the frontend follows (`shoal/v1/routes/{workspace}/{name}`)."""

KvHitRates = Callable[[], Mapping[int, float]]
"""KV cache hit rate (0..1) by instance id, for the instances the KV indexer knows."""


def no_routes() -> list[Mapping[str, Any]]:
    return []


def no_hit_rates() -> dict[int, float]:
    return {}


@dataclass
class _Failures:
    """Failures of one instance seen by sampling `Upstream.inhibited_until` (one per change)."""

    seen_until: float = 0.0
    times: deque[float] = field(default_factory=deque)


class FleetReader:
    """Reads one frontend for the dashboard; keeps only what sampling needs between reads.

    `routes` and `kv_hit_rates` are filled by whoever has the data: the frontend's routes
    follower (virtual models and providers from the catalog's models controller) and the
    KV indexer. Until then the dashboard shows an empty routes section and no hit rates.
    """

    def __init__(self, frontend: Fleet) -> None:
        self.frontend = frontend
        self.routes: RoutesSource = no_routes
        self.kv_hit_rates: KvHitRates = no_hit_rates
        self._failures: dict[str, _Failures] = {}

    def read(self) -> Sections:
        """Every section, as of now."""
        now = time.monotonic()
        sections: Sections = {
            "frontend": {"": _encode(self._frontend())},
            "membership": {"": _encode(self._membership())},
            "loops": {"": _encode(self._loops())},
            "models": self._models(),
            "instances": self._instances(now),
            "incomplete": self._incomplete(),
            "routes": self._routes(),
        }
        return sections

    def _frontend(self) -> dict[str, Any]:
        front = self.frontend
        watcher = front.watcher
        return {
            "version": __version__,
            "router": front.config.router,
            "namespaces": list(front.config.namespaces),
            "follows_membership": front.membership is not None,
            "loaded": watcher is not None and watcher.snapshot_loaded.is_set(),
            "draining": front.draining,
            "protected": bool(front.config.api_keys),
            "started_at": front.started_at,
        }

    def _membership(self) -> dict[str, Any] | None:
        membership = self.frontend.membership
        if membership is None:
            return None
        return {
            "status": membership.status.to_dict(),
            "namespaces": sorted(membership.view.scopes),
        }

    def _loops(self) -> list[dict[str, Any]]:
        manager = self.frontend.manager
        health = manager.health()
        loops: list[dict[str, Any]] = []
        for name, loop in sorted(manager.loops.items()):
            probe = health.get(name)
            loops.append(
                {
                    "name": name,
                    "healthy": bool(probe and probe.healthy),
                    "reason": probe.reason if probe else "not probed",
                    "heartbeat_age": round(loop.heartbeat.silence(), 1),
                    "interval": loop.interval,
                    "max_silence": loop.max_silence,
                }
            )
        return loops

    def _models(self) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for name, model in sorted(self.frontend.registry.models.items()):
            sets = [
                {
                    "namespace": ws.id.namespace,
                    "component": ws.id.component,
                    "role": str(ws.id.role),
                    "mdcsum": ws.mdcsum,
                    "members": len(ws.members),
                    "routable": len(ws.routable),
                }
                for ws in sorted(model.sets.values(), key=lambda ws: ws.id)
            ]
            out[name] = _encode(
                {
                    "key": name,
                    "name": name,
                    "serving": model.serving,
                    "disaggregated": model.stages is not None,
                    "incomplete": model.incomplete,
                    "live_instances": model.live_instances,
                    "types": sorted(str(t) for t in model.model_types),
                    "parent": model.parent,
                    "sets": sets,
                }
            )
        return out

    def _instances(self, now: float) -> dict[str, bytes]:
        """Endpoint instances: joined ones from the registry, the rest from the watcher."""
        rows: dict[str, dict[str, Any]] = {}
        upstreams: dict[str, Upstream] = {}
        for model in self.frontend.registry.models.values():
            for ws in model.sets.values():
                for member in ws.members.values():
                    key = member.key
                    row = _row(rows, key.endpoint.path, key.instance_id, member.upstream.url)
                    row["models"].add(member.card.display_name)
                    row["roles"].add(str(member.card.role))
                    row["taints"].update(member.card.taints)
                    row["joined"] = True
                    upstreams[row["key"]] = member.upstream
        watcher = self.frontend.watcher
        if watcher is not None:
            for registration in watcher.incomplete():
                model_instance = registration.model
                key = model_instance.key
                row = _row(rows, key.endpoint.path, key.instance_id, model_instance.url)
                row["models"].add(model_instance.card.display_name)
                row["roles"].add(str(model_instance.card.role))
                row["taints"].update(model_instance.card.taints)
                row["incomplete"].add(registration.state.value)
        hit_rates = self.kv_hit_rates()
        out: dict[str, bytes] = {}
        for row_key, row in sorted(rows.items()):
            upstream = upstreams.get(row_key)
            row["errors"] = self._count_failures(row_key, upstream, now)
            row["in_flight"] = upstream.in_flight if upstream is not None else 0
            row["inhibited"] = upstream is not None and upstream.inhibited_until > now
            row["kv_hit_rate"] = hit_rates.get(row["instance_id"])
            row["state"] = _state(row)
            for name in ("models", "roles", "taints", "incomplete"):
                row[name] = sorted(row[name])
            row["instance_id"] = f"{row['instance_id']:x}"
            del row["joined"]
            out[row_key] = _encode(row)
        for gone in self._failures.keys() - rows.keys():
            del self._failures[gone]
        return out

    def _count_failures(self, key: str, upstream: Upstream | None, now: float) -> int:
        """Failures in the last `ERROR_WINDOW` s: each new `inhibited_until` is one (or more)."""
        failures = self._failures.get(key)
        if failures is None:
            failures = self._failures[key] = _Failures()
        if upstream is not None:
            until = upstream.inhibited_until
            if until != 0.0 and until != failures.seen_until:
                failures.times.append(now)
            failures.seen_until = until
        while failures.times and failures.times[0] < now - ERROR_WINDOW:
            failures.times.popleft()
        return len(failures.times)

    def _incomplete(self) -> dict[str, bytes]:
        watcher = self.frontend.watcher
        if watcher is None:
            return {}
        out: dict[str, bytes] = {}
        for registration in watcher.incomplete():
            key = str(registration.model.key)
            out[key] = _encode(
                {
                    "key": key,
                    "model": registration.model.card.display_name,
                    "instance_id": f"{registration.model.key.instance_id:x}",
                    "state": registration.state.value,
                    "error": registration.error,
                }
            )
        return dict(sorted(out.items()))

    def _routes(self) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for i, route in enumerate(self.routes()):
            key = f"{route.get('workspace', '')}/{route.get('name', i)}"
            out[key] = _encode({"key": key, **route})
        return out


def _row(rows: dict[str, dict[str, Any]], path: str, instance_id: int, url: str) -> dict[str, Any]:
    key = f"{path}/{instance_id:x}"
    row = rows.get(key)
    if row is None:
        namespace, component, endpoint = path.split("/")
        row = rows[key] = {
            "key": key,
            "instance_id": instance_id,
            "namespace": namespace,
            "component": component,
            "endpoint": endpoint,
            "url": redact_url(url),  # (any client with a key reads this: not the credentials)
            "models": set(),
            "roles": set(),
            "taints": set(),
            "incomplete": set(),
            "joined": False,
        }
    return row


def _state(row: Mapping[str, Any]) -> str:
    """One word for the instance: what routing does with it, the most severe first."""
    if DRAINING in row["taints"]:
        return "draining"
    if row["taints"]:
        return "tainted"
    if not row["joined"]:
        return "refused" if "refused" in row["incomplete"] else "pending"
    if row["inhibited"]:
        return "inhibited"
    return "ready"


def diff(before: Sections, after: Sections) -> dict[str, Any]:
    """What changed from `before` to `after`: whole sections set, keyed items upserted or removed."""
    change: dict[str, Any] = {}
    for name in WHOLE:
        if before.get(name) != after[name]:
            change.setdefault("set", {})[name] = msgspec.Raw(after[name][""])
    for name in KEYED:
        old, new = before.get(name, {}), after[name]
        upserts = [msgspec.Raw(item) for key, item in new.items() if old.get(key) != item]
        removed = [key for key in old if key not in new]
        if upserts:
            change.setdefault("upsert", {})[name] = upserts
        if removed:
            change.setdefault("remove", {})[name] = removed
    return change


def full(sections: Sections) -> dict[str, Any]:
    """Every section as the page's snapshot: whole ones as values, keyed ones as lists."""
    out: dict[str, Any] = {name: msgspec.Raw(sections[name][""]) for name in WHOLE}
    for name in KEYED:
        out[name] = [msgspec.Raw(item) for item in sections[name].values()]
    return out


class RequestHistory:
    """A ring buffer of request rate, errors and TTFT, one point per `period` seconds."""

    def __init__(self, metrics: FrontendMetrics, *, period: float = 2.0, size: int = 300) -> None:
        self.metrics = metrics
        self.period = period
        self.points: deque[dict[str, Any]] = deque(maxlen=size)
        self._last: tuple[float, int, int, int, list[int]] | None = None

    def sample(self, now: float | None = None) -> dict[str, Any] | None:
        """Add the point for the period that just ended (None on the first call: no baseline)."""
        now = time.time() if now is None else now
        total = client = server = 0
        ttft = [0] * (len(TTFT_BUCKETS) + 1)
        for stats in list(self.metrics.models.values()):
            for status, count in list(stats.requests.items()):
                total += count
                if status >= 500:
                    server += count
                elif status >= 400:
                    client += count
            for i, count in enumerate(stats.ttft.counts):
                ttft[i] += count
        last, self._last = self._last, (now, total, client, server, ttft)
        if last is None or now <= last[0]:
            return None
        elapsed = now - last[0]
        deltas = [max(0, a - b) for a, b in zip(ttft, last[4], strict=True)]
        point = {
            "t": round(now, 3),
            "rps": round(max(0, total - last[1]) / elapsed, 3),
            "client_errors": round(max(0, client - last[2]) / elapsed, 3),
            "server_errors": round(max(0, server - last[3]) / elapsed, 3),
            "ttft_p50": percentile(deltas, 0.5),
            "ttft_p95": percentile(deltas, 0.95),
        }
        self.points.append(point)
        return point


def percentile(counts: list[int], q: float) -> float | None:
    """The `q` quantile of a TTFT bucket histogram (per-bucket counts), interpolated in its bucket."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    lower = 0.0
    for i, count in enumerate(counts):
        upper = TTFT_BUCKETS[i] if i < len(TTFT_BUCKETS) else TTFT_BUCKETS[-1]
        if count and seen + count >= rank:
            return round(lower + (upper - lower) * (rank - seen) / count, 4)
        seen += count
        lower = upper
    return TTFT_BUCKETS[-1]
