"""What the `/ui` dashboard shows: a JSON-able read of one frontend, and its request history.

`FleetReader.read()` walks the registry, the watcher's registrations, the control loops and
the membership through their public attributes and returns `Sections`: each section is a
mapping from a stable key to one JSON-encoded item, so that two reads can be diffed item by
item (`diff`) and a page of 1,000 instances receives only the rows that changed. A read is
bounded at any fleet size: at most `MAX_ROWS` rows a section, the most severe first, and
`totals` counting all; it yields to the event loop every `SLICE` items.

`RequestHistory` is the ring buffer behind the page's charts: every `period` seconds it turns
the process-wide request totals of `FrontendMetrics` into one point (requests/s, client and
server errors/s, TTFT percentiles of that period). The request path bumps those totals next
to the per-model counters (a dict and a list increment), so a sample reads about 20 numbers
whatever the number of models, and totals that never decrease chart no false drop when a
departed model's series are dropped.

Neither runs on the request path: the dashboard's timer calls them.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from shoal import __version__
from shoal.bounds import cut_for_reading
from shoal.controllers import ControllerManager
from shoal.discovery import ModelKey
from shoal.discovery.keys import MODELS
from shoal.frontend.http.upstream import Upstream
from shoal.frontend.registry.metrics import TTFT_BUCKETS, FrontendMetrics
from shoal.frontend.registry.registrations import Registration
from shoal.frontend.registry.registry import Member, Model, Registry, SetId, WorkerSet
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
WHOLE = ("frontend", "membership", "loops", "totals")  # small sections sent whole on change
STATES = ("draining", "tainted", "refused", "pending", "inhibited", "ready")  # most severe first
MAX_ROWS = 1000
"""The items a keyed section holds (models, instances, incomplete registrations): the most
severe first, then by key; `totals` counts them all. A page does not read a hundred thousand
rows, and a read of them held the event loop for seconds."""
ROW_BYTES = 4096
ROW_ITEMS = 8
ROW_CHARS = 256
"""A row over `ROW_BYTES` as JSON shows the first `ROW_ITEMS` of each list (an instance's
models and taints, a route's targets; `{name}_total` counts them) and `ROW_CHARS` characters
of each string (the last `…`); a model row, its first `ROW_ITEMS` worker sets. A row is then
a few kB whatever the store holds (64 taints fill a card's 1 MiB; 20 such instances made a
20 MB snapshot). (Rows within the bound, nearly all, are not walked: 1,000 took ~20 ms.)"""
SLICE = 2000  # items a read handles in one turn of the event loop
ROW_COST = 10  # a row built and encoded costs about this many items

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


class _Turns:
    """A read's work in the current turn of the event loop: `spent` yields to the loop once
    `SLICE` items were handled since the last yield, and `busy` sums the read's own time."""

    def __init__(self) -> None:
        self.done = 0
        self.busy = 0.0
        self._since = time.perf_counter()

    async def spent(self, items: int) -> None:
        self.done += items
        if self.done >= SLICE:
            await self.pause()

    async def pause(self) -> None:
        self.done = 0
        self.busy += time.perf_counter() - self._since
        await asyncio.sleep(0)
        self._since = time.perf_counter()

    def end(self) -> float:
        self.busy += time.perf_counter() - self._since
        return self.busy


_Source = Member | Registration  # what an instance row is read from: joined, or not yet
_PREFIX = len(MODELS)


class FleetReader:
    """Reads one frontend for the dashboard; keeps only what sampling needs between reads.

    A read is bounded at any fleet size: each keyed section holds at most `MAX_ROWS` items,
    the most severe first (`STATES`; models not serving), then by key, and `totals` counts
    everything; the read yields to the event loop every `SLICE` items and notes in `busy`
    the time it took of the loop. Reads must not overlap (`Dashboard` shares one).

    `routes` and `kv_hit_rates` are filled by whoever has the data: the frontend's routes
    follower (virtual models and providers from the catalog's models controller) and the
    KV indexer. Until then the dashboard shows an empty routes section and no hit rates.
    """

    def __init__(self, frontend: Fleet) -> None:
        self.frontend = frontend
        self.routes: RoutesSource = no_routes
        self.kv_hit_rates: KvHitRates = no_hit_rates
        self.busy = 0.0  # seconds of the event loop the last read took
        self._failures: dict[str, _Failures] = {}  # (instances that failed at least once)

    async def read(self) -> Sections:
        """Every section, as of now."""
        now = time.monotonic()
        turns = _Turns()
        instances, by_state = await self._instances(now, turns)
        models, not_serving = await self._models(turns)
        incomplete, incomplete_total = await self._incomplete(turns)
        totals = {
            "instances": sum(by_state.values()),
            "by_state": by_state,
            "models": len(self.frontend.registry.models),
            "models_not_serving": not_serving,
            "incomplete": incomplete_total,
            "rows_max": MAX_ROWS,
        }
        sections: Sections = {
            "frontend": {"": _encode(self._frontend())},
            "membership": {"": _encode(self._membership())},
            "loops": {"": _encode(self._loops())},
            "totals": {"": _encode(totals)},
            "models": models,
            "instances": instances,
            "incomplete": incomplete,
            "routes": await self._routes(turns),
        }
        self.busy = turns.end()
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

    async def _models(self, turns: _Turns) -> tuple[dict[str, bytes], int]:
        """At most `MAX_ROWS` models, those not serving first; and how many are not serving."""
        models = self.frontend.registry.models
        names = list(models)
        trouble: list[str] = []  # not serving, or serving with a worker set incomplete
        not_serving = 0
        for start in range(0, len(names), SLICE):
            for name in names[start : start + SLICE]:
                model = models.get(name)
                if model is not None and (not model.serving or model.incomplete):
                    trouble.append(name)
                    not_serving += not model.serving
            await turns.pause()
        chosen = await _first_rows([trouble, names], turns)
        out: dict[str, bytes] = {}
        for name in chosen:
            model = models.get(name)
            if model is not None:
                out[name] = _row(name, _model_row(name, model))
            await turns.spent(ROW_COST)
        return out, not_serving

    async def _instances(
        self, now: float, turns: _Turns
    ) -> tuple[dict[str, bytes], dict[str, int]]:
        """At most `MAX_ROWS` endpoint instances, the most severe state first (joined ones
        from the registry, the rest from the watcher); and how many are in each state."""
        sources: dict[str, list[_Source]] = {}
        states: dict[str, str] = {}
        sets = [ws for model in list(self.frontend.registry.models.values()) for ws in list(model.sets.values())]  # fmt: skip
        failures = self._failures
        for ws in sets:
            members = list(ws.members.values())
            for member in members:
                key = member.key
                row_key = key.key[_PREFIX:] if key.suffix is None else _row_key(key)
                upstream = member.upstream
                if upstream.inhibited_until != 0.0 or row_key in failures:
                    self._count_failures(row_key, upstream, now)
                found = sources.get(row_key)
                if found is None:
                    sources[row_key] = [member]
                    taints = member.card.taints
                    if taints:
                        states[row_key] = "draining" if DRAINING in taints else "tainted"
                    elif upstream.inhibited_until > now:
                        states[row_key] = "inhibited"
                    else:
                        states[row_key] = "ready"
                else:
                    found.append(member)
                    states[row_key] = ""  # several sources: decided below
            await turns.spent(len(members))
        watcher = self.frontend.watcher
        registrations = watcher.incomplete() if watcher is not None else []
        for start in range(0, len(registrations), SLICE):
            for registration in registrations[start : start + SLICE]:
                row_key = _row_key(registration.model.key)
                found = sources.get(row_key)
                if found is None:
                    sources[row_key] = [registration]
                states[row_key] = ""
                if found is not None:
                    found.append(registration)
            await turns.pause()
        for gone in [key for key in failures if key not in sources]:
            del failures[gone]
        by_state = dict.fromkeys(STATES, 0)
        buckets: dict[str, list[str]] = {state: [] for state in STATES}
        keys = list(states)  # (keys only: a list of 100,000 pairs took 16 ms to build)
        for start in range(0, len(keys), SLICE):
            for row_key in keys[start : start + SLICE]:
                state = states[row_key]
                if not state:
                    state = states[row_key] = _state_of(sources[row_key], now)
                by_state[state] += 1
                buckets[state].append(row_key)
            await turns.pause()
        chosen = await _first_rows([buckets[state] for state in STATES], turns)
        hit_rates = self.kv_hit_rates()
        out: dict[str, bytes] = {}
        for row_key in chosen:
            row = self._instance_row(row_key, sources[row_key], states[row_key], now)
            row["kv_hit_rate"] = hit_rates.get(row.pop("iid"))
            out[row_key] = _row(row_key, row)
            await turns.spent(ROW_COST)
        return out, by_state

    def _instance_row(
        self, row_key: str, sources: list[_Source], state: str, now: float
    ) -> dict[str, Any]:
        models: set[str] = set()
        adapters: set[str] = set()  # (listed after the base models: a row shows the first)
        roles: set[str] = set()
        taints: set[str] = set()
        incomplete: set[str] = set()
        upstreams: dict[int, Upstream] = {}  # (an instance's cards may share one, or not)
        url = ""
        for source in sources:
            if isinstance(source, Member):
                card, url = source.card, source.upstream.url
                upstreams[id(source.upstream)] = source.upstream
            else:
                card = source.model.card
                incomplete.add(source.state.value)
                url = url or source.model.url
            (models if card.lora is None else adapters).add(card.display_name)
            roles.add(str(card.role))
            taints.update(card.taints)
        path, _, iid = row_key.rpartition("/")
        namespace, component, endpoint = path.split("/")
        failures = self._failures.get(row_key)
        return {
            "key": row_key,
            "iid": int(iid, 16),
            "instance_id": iid,
            "namespace": namespace,
            "component": component,
            "endpoint": endpoint,
            "url": redact_url(url),  # (any client with a key reads this: not the credentials)
            "models": sorted(models) + sorted(adapters - models),
            "roles": sorted(roles),
            "taints": sorted(taints),
            "incomplete": sorted(incomplete),
            "errors": len(failures.times) if failures is not None else 0,
            "in_flight": sum(u.in_flight for u in upstreams.values()),
            "inhibited": any(u.inhibited_until > now for u in upstreams.values()),
            "state": state,
        }

    def _count_failures(self, key: str, upstream: Upstream, now: float) -> None:
        """Failures in the last `ERROR_WINDOW` s: each later `inhibited_until` than any seen is
        one (a failure inhibits until a later time; an instance's upstreams, one a URL, are
        sampled one after the other in a read, so only a newer time counts, whichever's)."""
        failures = self._failures.get(key)
        if failures is None:
            failures = self._failures[key] = _Failures()
        until = upstream.inhibited_until
        if until > failures.seen_until:
            failures.times.append(now)
            failures.seen_until = until
        while failures.times and failures.times[0] < now - ERROR_WINDOW:
            failures.times.popleft()

    async def _incomplete(self, turns: _Turns) -> tuple[dict[str, bytes], int]:
        """At most `MAX_ROWS` registrations not joined, by key; and how many there are."""
        watcher = self.frontend.watcher
        if watcher is None:
            return {}, 0
        registrations = watcher.incomplete()
        by_key: dict[str, Registration] = {}
        for start in range(0, len(registrations), SLICE):
            for registration in registrations[start : start + SLICE]:
                by_key[str(registration.model.key)] = registration
            await turns.pause()
        chosen = await _first_rows([list(by_key)], turns)
        out: dict[str, bytes] = {}
        for key in chosen:
            registration = by_key[key]
            out[key] = _row(
                key,
                {
                    "model": registration.model.card.display_name,
                    "instance_id": f"{registration.model.key.instance_id:x}",
                    "state": registration.state.value,
                    "error": registration.error,
                },
            )
            await turns.spent(ROW_COST)
        return out, len(registrations)

    async def _routes(self, turns: _Turns) -> dict[str, bytes]:
        """The routes, a row per virtual model (each target costs a row's encoding)."""
        out: dict[str, bytes] = {}
        for i, route in enumerate(self.routes()):
            key = f"{route.get('workspace', '')}/{route.get('name', i)}"
            out[key] = _row(key, route)
            await turns.spent(ROW_COST * (1 + len(route.get("targets") or ())))
        return out


async def _first_rows(groups: list[list[str]], turns: _Turns) -> list[str]:
    """The first `MAX_ROWS` keys of `groups`, a group before the next, by key within each
    (a key in two groups counts once: the first's)."""
    chosen: list[str] = []
    seen: set[str] = set()
    for group in groups:
        left = MAX_ROWS - len(chosen)
        if left <= 0:
            break
        fresh = [key for key in group if key not in seen] if seen else group
        if len(fresh) <= left:
            first = sorted(fresh)
        else:  # (a piece at a time: one pass over 100,000 keys held the loop 10 ms)
            first = []
            for start in range(0, len(fresh), 10 * SLICE):
                first = heapq.nsmallest(left, first + fresh[start : start + 10 * SLICE])
                await turns.pause()
        await turns.spent(len(first))
        chosen += first
        seen.update(first)
    return sorted(chosen)


def _row(key: str, row: Mapping[str, Any]) -> bytes:
    """A row as JSON, cut for reading when over `ROW_BYTES`; its key whole (the page
    replaces and removes rows by it)."""
    encoded = _encode({**row, "key": key})
    if len(encoded) <= ROW_BYTES:
        return encoded
    return _encode({**cut_for_reading(dict(row), ROW_ITEMS, ROW_CHARS), "key": key})


def _row_key(key: ModelKey) -> str:
    """An instance row's key: its endpoint's path and its id (the model key without the
    store's prefix and the adapter's suffix)."""
    return f"{key.endpoint.path}/{key.instance_id:x}"


def _state_of(sources: list[_Source], now: float) -> str:
    """One word for the instance: what routing does with it, the most severe first."""
    taints: set[str] = set()
    joined = inhibited = refused = False
    for source in sources:
        if isinstance(source, Member):
            joined = True
            taints.update(source.card.taints)
            inhibited = inhibited or source.upstream.inhibited_until > now
        else:
            taints.update(source.model.card.taints)
            refused = refused or source.state.value == "refused"
    if DRAINING in taints:
        return "draining"
    if taints:
        return "tainted"
    if not joined:
        return "refused" if refused else "pending"
    return "inhibited" if inhibited else "ready"


def _set_id(ws: WorkerSet) -> SetId:
    return ws.id


def _model_row(name: str, model: Model) -> dict[str, Any]:
    sets = [
        {
            "namespace": ws.id.namespace,
            "component": ws.id.component,
            "role": str(ws.id.role),
            "mdcsum": ws.mdcsum,
            "members": len(ws.members),
            "routable": len(ws.routable),
        }
        for ws in heapq.nsmallest(ROW_ITEMS, model.sets.values(), key=_set_id)
    ]
    return {
        "key": name,
        "name": name,
        "serving": model.serving,
        "disaggregated": model.stages is not None,
        "incomplete": model.incomplete,
        "live_instances": model.live_instances,
        "types": sorted(str(t) for t in model.model_types),
        "parent": model.parent,
        "sets": sets,
        "sets_total": len(model.sets),
    }


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
        """Add the point for the period that just ended (None on the first call: no baseline).

        Reads the process-wide `FrontendMetrics.totals` (a few numbers, whatever the number
        of models), which never decrease: a departed model's dropped series do not dent it."""
        now = time.time() if now is None else now
        totals = self.metrics.totals
        total = client = server = 0
        for status, count in list(totals.requests.items()):
            total += count
            if status >= 500:
                server += count
            elif status >= 400:
                client += count
        ttft = list(totals.ttft)
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
