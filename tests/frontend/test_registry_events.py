"""What one join, drain (taint) or departure costs the registry, and what it leaves behind."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest

from shoal.cards import ModelCard, ModelType
from shoal.discovery import EndpointId, InstanceInfo, ModelInstance, ModelKey
from shoal.frontend.registry.registry import Member, Registry

ENDPOINT = EndpointId("default", "backend", "generate")


def instance(
    instance_id: int,
    *,
    namespace: str = "default",
    suffix: str | None = None,
    types: tuple[str, ...] = ("chat",),
    created: int = 0,
    base: str | None = None,
    port: int | None = None,
) -> ModelInstance:
    """A card of model `m` (an adapter of `base` when given) on instance `instance_id`."""
    fields: dict[str, object] = {
        "display_name": "m",
        "slug": "m",
        "source": "test/m",
        "model_types": list(types),
        "context_length": 4096,
        "created": created,
    }
    if base is not None:
        fields["lora"] = {"base_model": base, "adapter": "adapters/m"}
    url = f"http://127.0.0.1:{port or 9000 + instance_id}"
    info = InstanceInfo(namespace, "backend", "generate", instance_id, f"{url}/v1", url)
    key = ModelKey(EndpointId(namespace, "backend", "generate"), instance_id, suffix)
    return ModelInstance(key, ModelCard.build(**fields), info)


@pytest.fixture
def card_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], int]]:
    """How many times the registry read a member's card so far: each member a change goes
    through reads it (its taints, kinds, `created`, parent)."""
    slot = Member.card  # the slot's descriptor
    reads = 0

    def get(member: Member) -> ModelCard:
        nonlocal reads
        reads += 1
        return slot.__get__(member, Member)  # type: ignore[attr-defined,no-any-return]

    def put(member: Member, card: ModelCard) -> None:
        slot.__set__(member, card)  # type: ignore[attr-defined]

    monkeypatch.setattr(Member, "card", property(get, put))

    def count() -> int:
        return reads

    yield count


def test_a_drain_or_departure_goes_through_no_member_but_its_own(
    card_reads: Callable[[], int],
) -> None:
    """A taint or a departure re-sorted the set's routable instances and went through every
    member of every set of the model (kinds, `created`, parent): 23-53 ms per event in a set
    of 30,000 instances, 80-108 ms at 100,000, on the event loop. Now each updates the set's
    routable tuple by the one instance and the model's kinds, `created` and parent from
    counts: the members read per event are the same in a set of 100 and of 2,000."""

    def reads_per_event(size: int) -> list[int]:
        registry = Registry()
        try:
            for i in range(1, size + 1):  # registered one second apart: all `created` differ
                registry.join(instance(i, created=1_700_000_000 + i))
            model = registry.models["m"]
            events: list[Callable[[], object]] = [
                lambda: registry.set_taints(ModelKey(ENDPOINT, 5), ("draining",)),
                lambda: registry.set_taints(ModelKey(ENDPOINT, 5), ("draining", "other")),
                lambda: registry.set_taints(ModelKey(ENDPOINT, 5), ()),
                lambda: registry.leave(ModelKey(ENDPOINT, 7)),
                lambda: registry.leave(ModelKey(ENDPOINT, 1)),  # the earliest `created`
                lambda: registry.set_taints(ModelKey(ENDPOINT, 2), ("draining",)),
                lambda: registry.leave(ModelKey(ENDPOINT, 2)),  # a tainted one
            ]
            counts = []
            for event in events:
                before = card_reads()
                event()
                counts.append(card_reads() - before)
            assert model.created == 1_700_000_003
            assert model.live_instances == size - 3
            ids = [u.instance_id for ws in model.routable_sets for u in ws.routable]
            assert ids == [i for i in range(1, size + 1) if i not in (1, 2, 7)]
            return counts
        finally:
            registry.close()

    small = reads_per_event(100)
    assert reads_per_event(2000) == small
    assert max(small) <= 8


def expected_routable(members: list[Member], kind: ModelType | None = None) -> list[int]:
    live = {
        m.upstream for m in members if not m.tainted and (kind is None or kind in m.model_types)
    }
    return sorted(id(u) for u in live)


def check(registry: Registry) -> None:
    """The registry as recomputing it from its members gives."""
    members: dict[str, list[Member]] = {}
    for key in list(registry._members):
        member = registry.member(key)
        assert member is not None
        members.setdefault(member.set_id.model, []).append(member)
    assert set(registry.models) == set(members)
    for name, model in registry.models.items():
        cards = [m.card for m in members[name]]
        assert model.model_types == {t for c in cards for t in c.model_types}
        assert model.created == min((c.created for c in cards if c.created), default=0)
        bases = {c.lora.base_model for c in cards if c.lora is not None}
        assert model.parent in bases if bases else model.parent is None
        for ws in model.sets.values():
            in_set = list(ws.members.values())
            routable = [u.instance_id for u in ws.routable]
            assert routable == sorted(routable)
            assert sorted(id(u) for u in ws.routable) == expected_routable(in_set)
            for kind in ModelType:
                view = ws.for_kind(kind)
                if view is None:
                    assert all(kind not in m.model_types for m in in_set)
                else:
                    assert sorted(id(u) for u in view.routable) == expected_routable(in_set, kind)
        assert model.live_instances == sum(len(ws.routable) for ws in model.routable_sets)


def test_worker_sets_and_models_stay_what_their_members_make_them_through_any_changes() -> None:
    """Kept up to date per change, not recomputed: routable instances (an instance with two
    cards in one set stays routable while either is untainted; an instance that moved keeps
    both addresses until its old cards leave), request kinds, `created` and parent, in a
    model of three sets."""
    rng = random.Random(7)
    registry = Registry()
    try:
        for _ in range(3000):
            # Three sets of model `m`: base-a's and base-b's adapters, and a model of its own.
            namespace = rng.choice(("default", "base-a", "base-b"))
            endpoint = EndpointId(namespace, "backend", "generate")
            key = ModelKey(endpoint, rng.randint(1, 12), rng.choice((None, "b")))
            op = rng.random()
            if op < 0.45:
                registry.join(
                    instance(
                        key.instance_id,
                        namespace=namespace,
                        suffix=key.suffix,
                        types=rng.choice((("chat",), ("chat",), ("chat", "embeddings"))),
                        created=rng.choice((0, 100, 200, 300 + key.instance_id)),
                        base=None if namespace == "default" else namespace,
                        port=rng.choice((None, 8000 + key.instance_id)),  # (it moved)
                    )
                )
            elif op < 0.75:
                registry.set_taints(key, tuple(rng.sample(("draining", "x"), rng.randint(0, 2))))
            else:
                registry.leave(key)
            check(registry)
    finally:
        registry.close()


def test_a_set_of_one_kind_and_a_model_with_a_leaving_kind() -> None:
    """The last card declaring a kind leaves: the model no longer serves it."""
    registry = Registry()
    try:
        registry.join(instance(1))
        registry.join(instance(2, types=("chat", "embeddings")))
        model = registry.models["m"]
        assert model.for_kind(ModelType.EMBEDDINGS) is not None
        registry.leave(ModelKey(ENDPOINT, 2))
        assert model.model_types == {ModelType.CHAT}
        assert model.for_kind(ModelType.EMBEDDINGS) is None
        assert all(not ws.kinds for ws in model.sets.values())  # one kind again: no views
        assert model.for_kind(ModelType.CHAT) is model
    finally:
        registry.close()
