"""Routing policies on a worker set of fake upstreams."""

from __future__ import annotations

import collections
import itertools
import tracemalloc

import pytest

from shoal.cards import WorkerRole
from shoal.frontend.http.upstream import Upstream
from shoal.frontend.proxy.proxy import Proxy
from shoal.frontend.registry.metrics import FrontendMetrics
from shoal.frontend.registry.registry import Model, Registry, SetId, WorkerSet
from shoal.frontend.registry.router import LeastLoaded, PrefixAware, Random, RoundRobin, make_router


def worker_set(n: int, *, first_port: int = 9000) -> WorkerSet:
    ws = WorkerSet(SetId("m", "ns", "backend", WorkerRole.AGGREGATED), f"sum{first_port}")
    ws.routable = tuple(
        Upstream(first_port - 8999 + i, f"http://127.0.0.1:{first_port + i}") for i in range(n)
    )
    return ws


def test_round_robin_cycles_through_the_set() -> None:
    ws = worker_set(3)
    router = RoundRobin()
    picks = [router.pick(ws).instance_id for _ in range(6)]  # type: ignore[union-attr]
    assert sorted(picks[:3]) == [1, 2, 3]
    assert picks[:3] == picks[3:]


def test_round_robin_keeps_a_cursor_per_set() -> None:
    a, b = worker_set(2), worker_set(2)
    router = RoundRobin()
    picks = [router.pick(ws).instance_id for _ in range(4) for ws in (a, b)]  # type: ignore[union-attr]
    assert sorted(picks[0::2]) == [1, 1, 2, 2]  # interleaving does not starve an instance


@pytest.mark.parametrize("policy", ["round-robin", "random", "least-loaded", "prefix"])
def test_every_policy_skips_excluded_and_inhibited_instances(policy: str) -> None:
    ws = worker_set(3)
    router = make_router(policy)
    ws.routable[0].inhibit(60)
    for _ in range(20):
        target = router.pick(ws, "prompt", [ws.routable[1]])
        assert target is ws.routable[2]


@pytest.mark.parametrize("policy", ["round-robin", "random", "least-loaded", "prefix"])
def test_an_inhibited_instance_is_used_only_when_nothing_else_is_left(policy: str) -> None:
    ws = worker_set(2)
    router = make_router(policy)
    ws.routable[0].inhibit(60)
    assert router.pick(ws, "p", [ws.routable[1]]) is None  # a policy never picks it ...
    model = model_of(ws)
    assert router.choose(model, "p", [ws.routable[1]]) is ws.routable[0]  # ... the model may
    assert router.choose(model, "p", list(ws.routable)) is None


def test_inhibition_expires() -> None:
    upstream = Upstream(1, "http://127.0.0.1:9")
    upstream.inhibit(-1)
    assert not upstream.inhibited


def test_random_reaches_every_instance() -> None:
    ws = worker_set(4)
    router = Random()
    seen = collections.Counter(router.pick(ws).instance_id for _ in range(400))  # type: ignore[union-attr]
    assert set(seen) == {1, 2, 3, 4}


def test_least_loaded_picks_the_fewest_in_flight() -> None:
    ws = worker_set(3)
    ws.routable[0].in_flight, ws.routable[1].in_flight, ws.routable[2].in_flight = 5, 1, 3
    assert LeastLoaded().pick(ws) is ws.routable[1]


def test_prefix_aware_sends_a_shared_prefix_to_the_same_instance() -> None:
    ws = worker_set(4)
    router = PrefixAware(block_chars=16)
    system = "You are a helpful assistant. " * 10
    first = router.pick(ws, system + "question one")
    assert first is not None
    first.in_flight += 1  # busy with it: least-loaded alone would go elsewhere
    for question in ("question two", "another question", "a third"):
        assert router.pick(ws, system + question) is first


def test_prefix_aware_falls_back_to_least_loaded_past_the_imbalance_threshold() -> None:
    ws = worker_set(2)
    router = PrefixAware(block_chars=16, balance_threshold=2)
    prompt = "shared prefix " * 20
    owner = router.pick(ws, prompt)
    assert owner is not None
    owner.in_flight = 3
    other = router.pick(ws, prompt)
    assert other is not owner


def test_prefix_index_is_bounded() -> None:
    ws = worker_set(2)
    router = PrefixAware(block_chars=4, capacity=50)
    for i in range(100):
        router.pick(ws, f"prompt number {i} " * 5)
    assert len(router.index.owners) <= 50


def test_unknown_policy_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="round-robin"):
        make_router("fastest")


def model_of(*sets: WorkerSet) -> Model:
    """A model served by `sets`, weighted by their sizes as the registry does it."""
    weights = tuple(itertools.accumulate(len(ws.routable) for ws in sets))
    return Model("m", 0, routable_sets=sets, _cum_weights=weights)


def proxy_with(policy: str) -> Proxy:
    return Proxy(Registry(), make_router(policy), FrontendMetrics())


@pytest.mark.parametrize("policy", ["round-robin", "random", "least-loaded", "prefix"])
def test_inhibited_instances_are_the_last_resort_across_all_sets(policy: str) -> None:
    hung, healthy = worker_set(1), worker_set(1, first_port=9100)
    hung.routable[0].inhibit(60)
    proxy = proxy_with(policy)
    model = model_of(hung, healthy)
    picks = {proxy.pick(model, "prompt", []) for _ in range(200)}
    assert picks == {healthy.routable[0]}
    # Only when every live instance was tried does an inhibited one get the request.
    assert proxy.pick(model, "prompt", [healthy.routable[0]]) is hung.routable[0]


@pytest.mark.parametrize("policy", ["round-robin", "random", "least-loaded", "prefix"])
def test_set_weights_ignore_inhibited_instances(policy: str) -> None:
    big, small = worker_set(4), worker_set(2, first_port=9100)
    for upstream in big.routable[1:]:
        upstream.inhibit(60)
    proxy = proxy_with(policy)
    model = model_of(big, small)
    picks = collections.Counter(proxy.pick(model, f"p{i}", []) for i in range(3000))
    live = [big.routable[0], *small.routable]
    assert set(picks) == set(live)
    for upstream in live:  # three live instances: a third each, whichever set holds them
        assert 0.25 < picks[upstream] / 3000 < 0.42


def test_the_last_resort_is_the_instance_whose_inhibition_ends_first() -> None:
    a, b = worker_set(2), worker_set(2, first_port=9100)
    for seconds, upstream in zip((40, 10, 30, 20), (*a.routable, *b.routable), strict=True):
        upstream.inhibit(seconds)
    proxy = proxy_with("round-robin")
    model = model_of(a, b)
    assert proxy.pick(model, None, []) is a.routable[1]
    assert proxy.pick(model, None, [a.routable[1]]) is b.routable[1]
    assert proxy.pick(model, None, [*a.routable, *b.routable]) is None


def test_prefix_memory_is_bounded_across_all_worker_sets() -> None:
    router = PrefixAware(block_chars=16, capacity=1000)
    sets = [worker_set(2) for _ in range(400)]  # e.g. 400 models, each seeing new prompts
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20):
            for n, ws in enumerate(sets):
                router.pick(ws, f"set {n} conversation {i} " * 8)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # 1,000 entries (about 150 KB) in all, not 1,000 per set (a set holds ~160 here: ~10 MB).
    assert grown < 1_000_000
