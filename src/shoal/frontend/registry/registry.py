"""The model registry: models → worker sets → instances, as the request path reads them.

A worker set is every instance of one model in one (namespace, component, role) whose cards
have the same `mdcsum`. The watcher elects the set's checksum from discovery (see
`versions`); the registry refuses a card with another checksum while the set has members
(another namespace may run another checksum: a rolling upgrade, and requests then pick a
set weighted by its live instances).

Everything a request needs is precomputed when membership changes, not per request: each
set's `routable` tuple (joined, untainted instances) and each model's routable sets with
their cumulative weights.

Disaggregated serving: `prefill` and `decode` sets whose cards have the same `pairsum` (the
checksum without the role) serve a model in two stages (`Model.stages`). The policy:
disaggregated when both stages have a routable instance, else aggregated (the `aggregated`
sets), else not serving. A stage set with no partner of its `pairsum` makes the model
incomplete (`Model.incomplete` says why): not listed, not served, until the other stage joins.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple, Protocol

from shoal.cards import ModelCard, ModelType, WorkerRole
from shoal.discovery import EndpointId, ModelInstance, ModelKey
from shoal.frontend.http.upstream import Upstream

# Roles a request is sent to whole; `prefill` and `decode` sets serve only as a pair (`Stages`).
ENTRY_ROLES = frozenset({WorkerRole.AGGREGATED})


class SetId(NamedTuple):
    """What a worker set is of: one model in one (namespace, component, role).

    A named tuple: built, hashed and compared in C, as every lookup of a member needs one.
    """

    model: str
    namespace: str
    component: str
    role: WorkerRole

    @classmethod
    def of(cls, key: ModelKey, card: ModelCard) -> SetId:
        return cls(card.display_name, key.endpoint.namespace, key.endpoint.component, card.role)


_TYPES: dict[tuple[ModelType, ...], frozenset[ModelType]] = {}
"""One frozenset per list of request kinds a card declares, shared by the members."""


@dataclass(eq=False, slots=True)
class Member:
    """A card that joined its worker set (`set_id`), and the instance that serves it."""

    key: ModelKey
    card: ModelCard
    upstream: Upstream
    set_id: SetId
    model_types: frozenset[ModelType] = field(init=False)  # the request kinds it declares

    def __post_init__(self) -> None:
        types = tuple(self.card.model_types)
        self.model_types = _TYPES.get(types) or _TYPES.setdefault(types, frozenset(types))

    @property
    def tainted(self) -> bool:
        return bool(self.card.taints)


@dataclass(eq=False)
class WorkerSet:
    """Instances of one model in one (namespace, component, role) with one checksum."""

    id: SetId
    mdcsum: str
    pairsum: str = ""  # the checksum without the role: which set of the other stage pairs with it
    members: dict[ModelKey, Member] = field(default_factory=dict)
    routable: tuple[Upstream, ...] = ()  # joined and untainted, by instance id
    cursor: int = 0  # round-robin position, kept per set so models do not skew each other
    router_state: object = None  # what a routing policy keeps per set (prefix index)
    model_types: frozenset[ModelType] = frozenset()  # declared by every member's card
    # When members declare different kinds: per kind, a set of the members declaring it.
    kinds: dict[ModelType, WorkerSet] = field(default_factory=dict)
    # How many untainted members use each routable upstream (more than one: cards of one
    # instance), so a change updates `routable` without going through the members.
    _live: dict[Upstream, int] = field(default_factory=dict, repr=False)

    def refresh(self) -> None:
        """Recompute from every member (after a change `add`/`remove` cannot make in place)."""
        self._live, self.routable = _routable(self.members.values())
        declared = {m.model_types for m in self.members.values()}
        if len(declared) <= 1:
            self.model_types = next(iter(declared), frozenset())
            self.kinds.clear()
            return
        self.model_types = frozenset().union(*declared)
        for kind in self.kinds.keys() - self.model_types:
            del self.kinds[kind]
        for kind in self.model_types:
            view = self.kinds.get(kind)
            if view is None:
                view = self.kinds[kind] = WorkerSet(self.id, self.mdcsum, self.pairsum)
            view.members = {k: m for k, m in self.members.items() if kind in m.model_types}
            view.model_types = frozenset({kind})
            view._live, view.routable = _routable(view.members.values())

    def add(self, member: Member) -> bool:
        """`member` was just added to `members`: update `routable` for it, in place of a
        `refresh` (which goes through every member: a set of ten thousand instances would
        take ten thousand steps per join). False, and nothing done, when its kinds differ
        from the set's: then a `refresh` is needed."""
        if self.kinds or member.model_types is not self.model_types:
            return False
        if not member.tainted:
            self._route_in(member.upstream)
        return True

    def remove(self, member: Member) -> bool:
        """`member` was just removed from `members`: as `add`, for a departure. False, and
        nothing done, when the set's members declare different kinds (a `refresh` then)."""
        if self.kinds:
            return False
        if not member.tainted:
            self._route_out(member.upstream)
        return True

    def retaint(self, member: Member, was_tainted: bool) -> None:
        """`member`'s taints changed (not its kinds: taints are all that can change)."""
        if member.tainted is was_tainted:
            return
        for ws in (self, *(self.kinds[kind] for kind in member.model_types if self.kinds)):
            if was_tainted:
                ws._route_in(member.upstream)
            else:
                ws._route_out(member.upstream)

    def _route_in(self, upstream: Upstream) -> None:
        """One more untainted member on `upstream`; routable from its first."""
        users = self._live.get(upstream, 0)
        self._live[upstream] = users + 1
        if not users:
            routable = self.routable
            i = bisect.bisect_left(routable, upstream.instance_id, key=_instance_id)
            self.routable = (*routable[:i], upstream, *routable[i:])

    def _route_out(self, upstream: Upstream) -> None:
        """One untainted member fewer on `upstream`; not routable once none is left (cards
        of one instance share its `Upstream`: an adapter's, or a card replaced)."""
        users = self._live.pop(upstream, 0)
        if users > 1:
            self._live[upstream] = users - 1
            return
        routable = self.routable
        i = bisect.bisect_left(routable, upstream.instance_id, key=_instance_id)
        while i < len(routable) and routable[i] is not upstream:
            i += 1  # (another upstream of the same instance id: one that moved)
        if i < len(routable):
            self.routable = (*routable[:i], *routable[i + 1 :])

    def for_kind(self, kind: ModelType) -> WorkerSet | None:
        """The members whose cards declare `kind` (this set itself when all of them do)."""
        if kind not in self.model_types:
            return None
        return self.kinds.get(kind, self)


def _routable(members: Iterable[Member]) -> tuple[dict[Upstream, int], tuple[Upstream, ...]]:
    """The untainted members per upstream, and those upstreams by instance id."""
    live: dict[Upstream, int] = {}
    for m in members:
        if not m.tainted:
            live[m.upstream] = live.get(m.upstream, 0) + 1
    return live, tuple(sorted(live, key=_instance_id))


_instance_id = attrgetter("instance_id")


class Stages(NamedTuple):
    """A model served in two stages: its prefill and its decode sets of one `pairsum`, each
    as a `Model` of those sets only (so routing policies pick in them as in any model)."""

    prefill: Model
    decode: Model
    pairsum: str = ""  # the checksum the two stages share


@dataclass(eq=False)
class Model:
    """A model name and its worker sets."""

    name: str
    created: int = 0  # the earliest `created` of its cards (0: none says): what every frontend sees
    sets: dict[SetId, WorkerSet] = field(default_factory=dict)
    routable_sets: tuple[WorkerSet, ...] = ()
    model_types: frozenset[ModelType] = frozenset()
    parent: str | None = None  # the base model of a LoRA adapter
    stages: Stages | None = None  # both stages routable: requests are served disaggregated
    incomplete: str | None = None  # why stage sets wait for their partner (None: they don't)
    _cum_weights: tuple[int, ...] = ()
    # Per request kind, the model restricted to instances declaring it (itself when every
    # set's members all declare the kinds the model serves: the common case).
    _kinds: dict[ModelType, Model] = field(default_factory=dict)
    # Of its members: how many declare each kind, registered at each `created`, and are
    # adapters of each base model (what `model_types`, `created` and `parent` derive from).
    _types: dict[ModelType, int] = field(default_factory=dict)
    _created: dict[int, int] = field(default_factory=dict)
    _parents: dict[str, int] = field(default_factory=dict)

    @property
    def serving(self) -> bool:
        """An aggregated set, or both stages of a pair, has a live, untainted instance."""
        return bool(self.routable_sets) or self.stages is not None

    @property
    def listed(self) -> bool:
        """Shown by `/v1/models`: serving, or its instances are only tainted (draining) for
        now, when requests are answered 503 with Retry-After rather than 404. A model whose
        stage sets lack their partner is not listed (`incomplete`)."""
        if self.serving or any(
            ws.members for ws in self.sets.values() if ws.id.role in ENTRY_ROLES
        ):
            return True
        return bool(_paired(self.sets.values(), routable=False))

    @property
    def first_sets(self) -> tuple[WorkerSet, ...]:
        """The routable sets a request's first (or only) stage is picked in: the aggregated
        ones, and the prefill stage's (what a routing policy prepares the prompt for)."""
        if self.stages is None:
            return self.routable_sets
        return self.routable_sets + self.stages.prefill.routable_sets

    @property
    def live_instances(self) -> int:
        live = self._cum_weights[-1] if self._cum_weights else 0  # (the routable sets' sizes)
        if self.stages is not None:
            live += self.stages.prefill.live_instances + self.stages.decode.live_instances
        return live

    def pick_set(self) -> WorkerSet | None:
        """A routable set, chosen with probability proportional to its live instances."""
        sets = self.routable_sets
        if len(sets) <= 1:
            return sets[0] if sets else None
        point = random.random() * self._cum_weights[-1]
        return sets[bisect.bisect_right(self._cum_weights, point)]

    def for_kind(self, kind: ModelType) -> Model | None:
        """The model as requests of `kind` see it: only instances whose card declares it.
        None when no card of the model declares `kind`."""
        return self._kinds.get(kind)

    def joined(self, ws: WorkerSet, member: Member) -> None:
        """`member` joined `ws` (one of `sets`): recompute what requests read, by what it adds."""
        if not ws.add(member):
            ws.refresh()
        self._count(member, 1)
        if member.card.lora is not None:
            self.parent = member.card.lora.base_model
        self._route()
        self._refresh_kinds()

    def left(self, ws: WorkerSet, member: Member) -> None:
        """`member` left `ws` (still in `sets` unless it was its last): as `joined`."""
        if not ws.remove(member):
            ws.refresh()
        self._count(member, -1)
        self._route()
        self._refresh_kinds()

    def retainted(self, ws: WorkerSet, member: Member, was_tainted: bool) -> None:
        """`member`'s taints changed: its routability only (not kinds, `created`, parent)."""
        ws.retaint(member, was_tainted)
        self._route()
        self._refresh_kinds()

    def _count(self, member: Member, step: int) -> None:
        """Count `member`'s kinds, `created` and parent in or out (`step` 1 or -1), and
        derive the model's from the counts: a change never goes through the members."""
        card, types = member.card, self._types
        for kind in member.model_types:
            count = types.get(kind, 0) + step
            if count:
                types[kind] = count
            else:
                del types[kind]
            if count == 0 or (count == 1 and step > 0):  # (a kind's first card, or its last)
                self.model_types = frozenset(types)
        if card.created:
            count = self._created.get(card.created, 0) + step
            if count:
                self._created[card.created] = count
            else:
                del self._created[card.created]
            if step > 0 and (not self.created or card.created < self.created):
                self.created = card.created
            elif not count and card.created == self.created:
                self.created = min(self._created, default=0)  # (distinct times, not members)
        if card.lora is not None:
            base = card.lora.base_model
            count = self._parents.get(base, 0) + step
            if count:
                self._parents[base] = count
            else:
                del self._parents[base]
                if self.parent == base:
                    self.parent = next(reversed(self._parents), None)

    def _route(self) -> None:
        """Routable sets and their cumulative weights, from the sets' `routable` tuples; the
        stages when a prefill and a decode set of one `pairsum` both have routable instances."""
        self._weigh(ws for ws in self.sets.values() if ws.routable and ws.id.role in ENTRY_ROLES)
        pairs = _paired(self.sets.values(), routable=True)
        serving = self.stages.pairsum if self.stages is not None else None
        stages = None
        if pairs:
            # One pair serves: the most decode instances, then the one serving (no flapping
            # between equals), then the greater checksum. Requests never mix checksums.
            def rank(p: str) -> tuple[int, bool, str]:
                return (sum(len(ws.routable) for ws in pairs[p][1]), p == serving, p)

            pairsum = max(pairs, key=rank)
            prefill, decode = pairs[pairsum]
            stages = Stages(self._stage(prefill), self._stage(decode), pairsum)
        self.stages = stages
        self.incomplete = _incomplete(self.sets.values())

    def _stage(self, sets: list[WorkerSet]) -> Model:
        stage = Model(self.name, sets={ws.id: ws for ws in sets})
        stage._weigh(sets)
        return stage

    def _weigh(self, sets: Iterable[WorkerSet]) -> None:
        self.routable_sets = tuple(sets)
        weights: list[int] = []
        total = 0
        for ws in self.routable_sets:
            total += len(ws.routable)
            weights.append(total)
        self._cum_weights = tuple(weights)

    def _refresh_kinds(self) -> None:
        kinds: set[ModelType] = set()
        for ws in self.sets.values():
            kinds.update(ws.model_types)
        uniform = all(not ws.kinds and ws.model_types == kinds for ws in self.sets.values())
        old, self._kinds = self._kinds, {}
        for kind in kinds:
            if uniform:
                self._kinds[kind] = self
                continue
            view = old.get(kind)
            if view is None or view is self:
                view = Model(self.name)
            view.sets = {
                set_id: narrowed
                for set_id, ws in self.sets.items()
                if (narrowed := ws.for_kind(kind)) is not None
            }
            view._route()
            view.model_types = frozenset({kind})
            view.created, view.parent = self.created, self.parent
            self._kinds[kind] = view


def _paired(
    sets: Iterable[WorkerSet], *, routable: bool
) -> dict[str, tuple[list[WorkerSet], list[WorkerSet]]]:
    """The prefill and decode sets of each `pairsum` that has both (with a routable instance
    in each stage when `routable`; with members otherwise)."""
    stages: dict[str, tuple[list[WorkerSet], list[WorkerSet]]] = {}
    for ws in sets:
        if ws.id.role is WorkerRole.AGGREGATED or not (ws.routable if routable else ws.members):
            continue
        prefill, decode = stages.setdefault(ws.pairsum, ([], []))
        (prefill if ws.id.role is WorkerRole.PREFILL else decode).append(ws)
    return {p: pair for p, pair in stages.items() if pair[0] and pair[1]}


def _incomplete(sets: Iterable[WorkerSet]) -> str | None:
    """Why stage sets cannot serve: a role without a set of the other role and same checksum."""
    roles: dict[str, set[WorkerRole]] = {}
    for ws in sets:
        if ws.id.role is not WorkerRole.AGGREGATED and ws.members:
            roles.setdefault(ws.pairsum, set()).add(ws.id.role)
    reasons = []
    for pairsum, have in sorted(roles.items()):
        if len(have) == 1:
            (role,) = have
            other = WorkerRole.DECODE if role is WorkerRole.PREFILL else WorkerRole.PREFILL
            reasons.append(
                f"{role} worker set(s) of checksum {pairsum} have no {other} set of the same "
                f"model: waiting for {other} workers"
            )
    return "; ".join(reasons) or None


class RegistryObserver(Protocol):
    """Told of every card that joins or leaves a worker set (the KV indexer follows these)."""

    def joined(self, model: ModelInstance, ws: WorkerSet) -> None: ...

    def left(self, key: ModelKey, ws: WorkerSet) -> None: ...


class RefusedError(Exception):
    """The card's checksum differs from its worker set's."""


class Registry:
    """Models by name, their worker sets, and the `Upstream` of every joined instance."""

    def __init__(self, *, connect_timeout: float = 5.0) -> None:
        self.models: dict[str, Model] = {}
        self.connect_timeout = connect_timeout
        self._members: dict[ModelKey, Member] = {}
        # The `Upstream` of each joined instance, by endpoint and instance id, and how many
        # cards use it when more than one does (an instance serving adapters).
        self._upstreams: dict[EndpointId, dict[int, Upstream]] = {}
        self._upstream_users: dict[tuple[EndpointId, int], int] = {}
        self.version = 0  # bumped by every change: what is derived from the registry compares it
        self.observers: list[RegistryObserver] = []

    def __contains__(self, key: ModelKey) -> bool:
        return key in self._members

    def __len__(self) -> int:
        """Cards joined to a worker set."""
        return len(self._members)

    def member(self, key: ModelKey) -> Member | None:
        return self._members.get(key)

    def members_of(self, keys: Iterable[ModelKey]) -> list[Member | None]:
        """`member` of each of `keys`, looked up in a C loop (a pass checks a whole fleet)."""
        return list(map(self._members.get, keys))

    def worker_set(self, key: ModelKey) -> WorkerSet | None:
        member = self._members.get(key)
        if member is None:
            return None
        return self.models[member.set_id.model].sets.get(member.set_id)

    def join(self, model: ModelInstance) -> WorkerSet:
        """Add a card whose metadata is verified to its worker set; `RefusedError` on a checksum clash."""
        key, card = model.key, model.card
        if key in self._members:
            self.leave(key)
        set_id = SetId.of(key, card)
        entry = self.models.get(set_id.model)
        ws = entry.sets.get(set_id) if entry is not None else None
        if ws is not None and ws.mdcsum != model.mdcsum:
            raise RefusedError(
                f"card {key} of {card.display_name!r} has checksum {model.mdcsum}, but its "
                f"worker set in {set_id.namespace}/{set_id.component} ({set_id.role}) runs "
                f"{ws.mdcsum}: refused (upgrade in another namespace, or stop the old workers)"
            )
        if entry is None:
            entry = self.models[set_id.model] = Model(set_id.model)
        if ws is None:
            pairsum = card.pairsum
            ws = entry.sets[set_id] = WorkerSet(set_id, model.mdcsum, pairsum)
        member = Member(key, card, self._acquire_upstream(model), ws.id)  # (one id per set)
        ws.members[key] = self._members[key] = member
        entry.joined(ws, member)
        self.version += 1
        for observer in self.observers:
            observer.joined(model, ws)
        return ws

    def leave(self, key: ModelKey) -> SetId | None:
        """Remove a card; returns its set's id, or None if it was not joined."""
        left = self._members.pop(key, None)
        if left is None:
            return None
        set_id = left.set_id
        entry = self.models[set_id.model]
        ws = entry.sets[set_id]
        member = ws.members.pop(key)
        self._release_upstream(key, member.upstream)
        if not ws.members:
            del entry.sets[set_id]
        if entry.sets:
            entry.left(ws, member)
        else:
            del self.models[set_id.model]
        self.version += 1
        for observer in self.observers:
            observer.left(key, ws)
        return set_id

    def set_taints(self, key: ModelKey, taints: tuple[str, ...]) -> None:
        member = self._members.get(key)
        if member is None:
            return
        entry = self.models[member.set_id.model]
        was_tainted = member.tainted
        member.card = member.card.with_taints(list(taints))
        entry.retainted(entry.sets[member.set_id], member, was_tainted)
        self.version += 1

    def serving(self) -> list[Model]:
        """Models that can take requests now, by name."""
        return [m for _, m in sorted(self.models.items()) if m.serving]

    def listed(self) -> list[Model]:
        """Models `/v1/models` shows (serving, or draining for now), by name."""
        return [m for _, m in sorted(self.models.items()) if m.listed]

    def close(self) -> None:
        for upstreams in self._upstreams.values():
            for upstream in upstreams.values():
                upstream.close()
        self._upstreams.clear()
        self._upstream_users.clear()

    def _acquire_upstream(self, model: ModelInstance) -> Upstream:
        endpoint, instance_id = model.key.endpoint, model.key.instance_id
        upstreams = self._upstreams.setdefault(endpoint, {})
        held = upstreams.get(instance_id)
        if held is not None and held.url == model.url:
            ident = (endpoint, instance_id)
            self._upstream_users[ident] = self._upstream_users.get(ident, 1) + 1
            return held
        upstream = Upstream(model.instance_id, model.url, connect_timeout=self.connect_timeout)
        if held is not None:  # the instance moved: new cards go to the new address
            held.close()
            self._upstream_users.pop((endpoint, instance_id), None)
        upstreams[instance_id] = upstream
        return upstream

    def _release_upstream(self, key: ModelKey, upstream: Upstream) -> None:
        endpoint, instance_id = key.endpoint, key.instance_id
        upstreams = self._upstreams.get(endpoint)
        if upstreams is None or upstreams.get(instance_id) is not upstream:
            upstream.close()
            return
        ident = (endpoint, instance_id)
        users = self._upstream_users.pop(ident, 1)
        if users > 2:
            self._upstream_users[ident] = users - 1
        elif users <= 1:
            del upstreams[instance_id]
            if not upstreams:
                del self._upstreams[endpoint]
            upstream.close()
