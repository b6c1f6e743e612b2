"""`KvTracker` follows the instances the registry routes to, and only those."""

from __future__ import annotations

import msgspec

from shoal.cards import ModelCard
from shoal.discovery import EndpointId, InstanceInfo, ModelInstance, ModelKey
from shoal.frontend.kv.tracker import KvTracker
from shoal.frontend.registry.registry import Registry
from shoal.kv import KvEndpoint, token_block_hashes
from tests.helpers import wait_for
from tests.kv import vllm_fixtures as vllm
from tests.kv.fake_vllm import FakeVllmPublisher

TOKENS = list(range(32))
CARD = ModelCard.build(
    display_name="m", slug="m", source="test/m", model_types=["chat"], context_length=4096
)


def instance(namespace: str, instance_id: int, publisher: FakeVllmPublisher) -> ModelInstance:
    endpoint = EndpointId(namespace, "backend", "generate")
    info = InstanceInfo(
        namespace, "backend", "generate", instance_id, f"http://127.0.0.1:{9000 + instance_id}",
        f"http://127.0.0.1:{9100 + instance_id}",
        kv_events=KvEndpoint(publisher=publisher.endpoint, replay=publisher.replay_endpoint),
    )  # fmt: skip
    return ModelInstance(ModelKey(endpoint, instance_id), CARD, info)


async def test_instances_outside_the_membership_view_are_purged_and_unfollowed() -> None:
    publishers = [FakeVllmPublisher(), FakeVllmPublisher()]
    registry, tracker = Registry(), KvTracker()
    registry.observers.append(tracker)
    try:
        sets = [
            registry.join(instance(ns, i + 1, p))
            for i, (ns, p) in enumerate(zip(("a", "b"), publishers, strict=True))
        ]
        stored = vllm.batch(vllm.stored([1], None, TOKENS[:16], 16))
        for p in publishers:
            await p.send(0, stored)
        hashes = token_block_hashes(TOKENS, 16)

        def held(i: int) -> dict[int, int]:
            return tracker.sets[sets[i].id].index.overlaps(hashes)

        await wait_for(lambda: held(0) == {1: 1} and held(1) == {2: 1}, message="both indexed")
        tracker.retain(lambda endpoint: endpoint.namespace == "a")
        assert held(1) == {} and held(0) == {1: 1}
        await publishers[1].send(1, msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]]]))
        await publishers[1].send(2, stored)  # b's stream is no longer read: nothing comes back
        await publishers[0].send(1, vllm.batch(vllm.removed([1])))
        await wait_for(lambda: held(0) == {}, message="a still followed")
        assert held(1) == {}
    finally:
        await tracker.close()
        registry.close()
        for p in publishers:
            await p.close()
