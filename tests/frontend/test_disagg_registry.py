"""The serving rules of disaggregated models: prefill and decode sets pair up by checksum."""

from __future__ import annotations

from typing import Any

from shoal.cards import ModelCard, WorkerRole
from shoal.discovery import EndpointId, InstanceInfo, ModelInstance, ModelKey
from shoal.frontend.registry.registry import Registry


def instance(
    instance_id: int,
    role: WorkerRole,
    *,
    component: str = "backend",
    source: str = "test/m",
    taints: tuple[str, ...] = (),
    config: dict[str, Any] | None = None,
) -> ModelInstance:
    endpoint = EndpointId("default", component, "generate")
    card = ModelCard.build(
        display_name="m",
        slug="m",
        source=source,
        model_types=["chat", "completions"],
        context_length=4096,
        role=role,
        runtime_config={"taints": list(taints), **(config or {})},
    )
    url = f"http://127.0.0.1:{9000 + instance_id}"
    info = InstanceInfo("default", component, "generate", instance_id, f"{url}/v1", url)
    return ModelInstance(ModelKey(endpoint, instance_id), card, info)


def ids(model: object) -> list[int]:
    sets = getattr(model, "routable_sets", ())
    return sorted(u.instance_id for ws in sets for u in ws.routable)


def test_stage_cards_pair_by_the_checksum_without_the_role() -> None:
    prefill = instance(1, WorkerRole.PREFILL).card
    decode = instance(2, WorkerRole.DECODE).card
    assert prefill.mdcsum != decode.mdcsum  # each stage is its own worker set
    assert prefill.pairsum == decode.pairsum
    assert instance(3, WorkerRole.DECODE, source="other").card.pairsum != prefill.pairsum


def test_a_prefill_set_alone_is_incomplete_and_not_listed_until_a_decode_set_joins() -> None:
    registry = Registry()
    try:
        registry.join(instance(1, WorkerRole.PREFILL, component="prefill"))
        model = registry.models["m"]
        assert not model.serving and not model.listed and model.stages is None
        assert model.incomplete is not None and "no decode set" in model.incomplete
        assert registry.listed() == []
        registry.join(instance(2, WorkerRole.DECODE, component="decode"))
        assert model.serving and model.listed and model.incomplete is None
        assert model.stages is not None
        assert ids(model.stages.prefill) == [1] and ids(model.stages.decode) == [2]
        assert model.routable_sets == ()  # nothing is sent whole to a stage worker
        assert model.live_instances == 2
    finally:
        registry.close()


def test_a_decode_set_alone_is_incomplete_and_never_takes_requests_whole() -> None:
    registry = Registry()
    try:
        registry.join(instance(2, WorkerRole.DECODE))
        model = registry.models["m"]
        assert not model.serving and not model.listed
        assert model.incomplete is not None and "no prefill set" in model.incomplete
    finally:
        registry.close()


def test_stage_sets_of_different_checksums_do_not_pair() -> None:
    registry = Registry()
    try:
        registry.join(instance(1, WorkerRole.PREFILL, component="prefill"))
        registry.join(instance(2, WorkerRole.DECODE, component="decode", source="other"))
        model = registry.models["m"]
        assert not model.serving and model.stages is None
        assert model.incomplete is not None
        assert "no decode set" in model.incomplete and "no prefill set" in model.incomplete
    finally:
        registry.close()


def test_disaggregated_when_both_stages_are_ready_else_aggregated() -> None:
    registry = Registry()
    try:
        registry.join(instance(1, WorkerRole.AGGREGATED))
        registry.join(instance(2, WorkerRole.PREFILL, component="prefill"))
        registry.join(instance(3, WorkerRole.DECODE, component="decode"))
        model = registry.models["m"]
        assert model.stages is not None and ids(model) == [1]
        # The only decode instance drains: the stages are not ready, aggregated serves.
        registry.set_taints(instance(3, WorkerRole.DECODE, component="decode").key, ("draining",))
        assert model.stages is None and model.serving and ids(model) == [1]
        assert model.incomplete is None  # the pair is there, only not ready
        registry.set_taints(instance(3, WorkerRole.DECODE, component="decode").key, ())
        assert model.stages is not None
    finally:
        registry.close()


def test_a_drained_pair_stays_listed_and_answers_503() -> None:
    registry = Registry()
    try:
        registry.join(instance(2, WorkerRole.PREFILL, component="prefill", taints=("draining",)))
        registry.join(instance(3, WorkerRole.DECODE, component="decode"))
        model = registry.models["m"]
        assert not model.serving and model.listed and model.incomplete is None
    finally:
        registry.close()


def test_of_two_ready_pairs_the_one_with_more_decode_instances_serves() -> None:
    """A rolling upgrade: a pair of another checksum joins beside the serving one. The pair
    with the most decode instances serves, its own prefills with its own decodes; the model
    never stops serving (comparing the pairs raised, and left it without stages: 503s)."""
    registry = Registry()
    try:
        registry.join(instance(1, WorkerRole.PREFILL, component="prefill"))
        registry.join(instance(2, WorkerRole.DECODE, component="decode"))
        registry.join(instance(3, WorkerRole.PREFILL, component="prefill-v2", source="v2"))
        model = registry.models["m"]
        assert model.serving and model.stages is not None  # (v2 has no decode yet)
        assert ids(model.stages.prefill) == [1] and ids(model.stages.decode) == [2]
        registry.join(instance(4, WorkerRole.DECODE, component="decode-v2", source="v2"))
        # As many decodes in each: the pair serving goes on serving (no flapping).
        assert model.serving and model.stages is not None
        assert ids(model.stages.prefill) == [1] and ids(model.stages.decode) == [2]
        registry.join(instance(5, WorkerRole.DECODE, component="decode-v2", source="v2"))
        assert model.stages is not None
        assert ids(model.stages.prefill) == [3] and ids(model.stages.decode) == [4, 5]
    finally:
        registry.close()
