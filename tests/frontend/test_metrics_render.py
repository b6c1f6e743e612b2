"""`/metrics`' per-model series, written as text a slice of models at a time (metrics.py)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, ClassVar

from prometheus_client import generate_latest

from shoal.cards import ModelCard
from shoal.discovery import FleetTarget, InstanceInfo, ModelInstance, ModelKey, Route
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.registry.metrics import RENDER_SLICE, FrontendMetrics, _PerModel
from shoal.frontend.registry.registry import Model
from shoal.frontend.virtual.virtual import VirtualModel
from tests.helpers import LoopTurns

NAMES = ["plain", 'a "quoted" one', "back\\slash", "new\nline", "ünïcode", "no traffic"]


def metrics_with_traffic(names: list[str]) -> FrontendMetrics:
    metrics = FrontendMetrics()
    metrics.live_instances = lambda: {name: i for i, name in enumerate(names)}
    for i, name in enumerate(names[:-1]):
        stats = metrics.model(name)
        stats.count(200)
        stats.count(503 if i % 2 else 200)
        stats.retries, stats.in_flight = i, i % 3
        stats.ttft.observe(0.02 * i)
        stats.duration.observe(1e-9 + i * 7.5)
        stats.duration.observe(1e12)  # past the last bound
    for name in names[1::2]:  # (refused cards: models with requests here or none)
        metrics.card_refused(name)
    metrics.card_refused(names[1])
    return metrics


def test_the_per_model_series_are_written_as_prometheus_client_writes_them() -> None:
    """Line for line what `generate_latest` writes of the same families (the registry the
    tests read still holds them): names with quotes, backslashes, newlines, non-ASCII."""
    metrics = metrics_with_traffic(NAMES)
    ours = metrics.render().decode()
    theirs = generate_latest(metrics.registry).decode()
    assert sorted(ours.splitlines()) == sorted(theirs.splitlines())
    assert 'shoal_frontend_requests_total{model="a \\"quoted\\" one",status="503"} 1.0' in ours
    assert 'shoal_frontend_live_instances{model="new\\nline"} 3.0' in ours
    assert 'shoal_frontend_cards_refused_total{model="a \\"quoted\\" one"} 2.0' in ours


def test_each_family_is_written_in_one_piece() -> None:
    """The text format wants every sample of a family after its TYPE line, before the next."""
    text = metrics_with_traffic(NAMES).render().decode()
    families: list[str] = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            families.append(line.split()[2])
        elif not line.startswith("#"):
            assert line.startswith(families[-1]), line
    assert len(families) == len(set(families))


async def test_a_scrape_of_many_models_lets_the_event_loop_run_between_slices() -> None:
    """`render_sliced` yields after every `RENDER_SLICE` models: the loop runs other work
    while 10,000 models' series are written (counted: the models written per turn of the
    loop), and the text is what `render` writes."""
    names = [f"model-{i:05d}" for i in range(10_000)]
    metrics = metrics_with_traffic(names)
    written = LoopTurns().wrap(_PerModel, "add_stats", lambda text, models: len(models))
    try:
        pieces = await metrics.render_sliced()
    finally:
        await written.stop()
    assert written.on_loop == len(names) - 1  # (the models with traffic: all but the last)
    assert written.most_per_turn <= RENDER_SLICE, f"{written.most_per_turn} models in one turn"
    text = b"".join(pieces)
    assert sorted(text.splitlines()) == sorted(metrics.render().splitlines())


def test_a_collector_another_layer_registers_is_rendered_too() -> None:
    """What the KV router or the control loops register on the frontend's registry is in
    `/metrics`, beside the per-model series written as text."""
    from prometheus_client import Gauge

    metrics = metrics_with_traffic(NAMES)
    Gauge(
        "shoal_test_registered_later", "A collector of another layer.", registry=metrics.registry
    ).set(3)
    text = metrics.render().decode()
    assert "shoal_test_registered_later 3.0" in text
    assert text.count("# TYPE shoal_frontend_live_instances gauge") == 1


async def test_refused_cards_are_written_a_slice_at_a_time_not_in_one_piece() -> None:
    """The `cards_refused` family was a `prometheus_client` counter written in one piece
    with the rest of the registry, and every series of it walked again at each scrape to
    find the departed (2,000 refused cards: a 97 ms turn of the event loop). Now its series
    are written with the per-model ones, `RENDER_SLICE * 8` per turn at most."""
    names = [f"org/adapter-{i:05d}" for i in range(20_000)]
    metrics = FrontendMetrics()
    for name in names:
        metrics.card_refused(name)
    # (the refused series written per turn of the loop: `add_counts` of family -1)
    written = LoopTurns().wrap(
        _PerModel, "add_counts", lambda text, family, counts: len(counts) if family == -1 else 0
    )
    try:
        pieces = await metrics.render_sliced()
    finally:
        await written.stop()
    assert b"cards_refused_total{" not in pieces[0]  # (not in the registry's text)
    assert written.on_loop == len(names)
    assert written.most_per_turn <= RENDER_SLICE * 8, f"{written.most_per_turn} in one turn"
    text = b"".join(pieces).decode()
    assert text.count("\nshoal_frontend_cards_refused_total{") == len(names)


class Name(str):
    """A model name that counts its comparisons, per turn of the event loop (`turns`): the
    work sorting names holds the loop for, counted, not timed."""

    turns: ClassVar[LoopTurns | None] = None

    def __lt__(self, other: str) -> bool:
        if Name.turns is not None:
            Name.turns.note()
        return str.__lt__(self, other)


def labels(text: str, family: str) -> list[str]:
    """The model label of each line of `family`, in the order written."""
    start = family + '{model="'
    return [
        line[len(start) :].split('"')[0] for line in text.splitlines() if line.startswith(start)
    ]


async def test_a_scrape_sorts_the_names_of_a_large_fleet_a_slice_per_turn() -> None:
    """`/metrics` sorted every model's name in one turn of the loop (`sorted(models.items())`,
    then the live models'): 30,000 names held it 11 ms, 100,000 83 ms, before a line was
    written. Now runs of names are sorted and merged a slice per turn, counted here in
    comparisons of names per turn; every family is still written in the order of its names."""
    rng = random.Random(7)
    names = [Name(f"org/adapter-{rng.getrandbits(40):012x}") for _ in range(20_000)]
    metrics = metrics_with_traffic(names)  # (live: all of them; traffic: all but the last)
    Name.turns = compared = LoopTurns()
    try:
        pieces = await metrics.render_sliced()
    finally:
        Name.turns = None
    worst = compared.most_per_turn
    # (a run of RENDER_SLICE * 8 names sorted: ~10 comparisons a name; all 20,000: ~14 each)
    assert worst <= RENDER_SLICE * 8 * 16, f"{worst:,} comparisons of names in one turn"
    text = b"".join(pieces).decode()
    assert labels(text, "shoal_frontend_live_instances") == sorted(names)
    assert labels(text, "shoal_frontend_inflight_requests") == sorted(names[:-1])
    assert text == metrics.render().decode()


def fleet_instance(instance_id: int, model: str) -> ModelInstance:
    card = ModelCard.build(
        display_name=model,
        slug=model,
        source=f"test/{model}",
        model_types=["chat"],
        context_length=4096,
    )
    url = f"http://127.0.0.1:{9000 + instance_id}"
    info = InstanceInfo("default", "backend", "generate", instance_id, f"{url}/v1", url)
    return ModelInstance(ModelKey(info.endpoint_id, instance_id), card, info)


class CountedPerTurn:
    """Counts the reads of a property of some classes per turn of the event loop
    (`LoopTurns`: a property is read through the class, which `LoopTurns.wrap` does not
    replace)."""

    def __init__(self, *owners: type, name: str) -> None:
        self.turns = LoopTurns()
        self._undo: list[tuple[type, Any]] = []
        for owner in owners:
            real = owner.__dict__[name]
            self._undo.append((owner, real))
            setattr(owner, name, property(self._counted(real.fget)))
        self.name = name

    def _counted(self, read: Any) -> Any:
        def counted(obj: Any) -> Any:
            self.turns.note()
            return read(obj)

        return counted

    def stop(self) -> int:
        """The most reads in one turn."""
        for owner, real in self._undo:
            setattr(owner, self.name, real)
        return self.turns.most_per_turn


async def test_the_live_instances_of_models_and_routes_are_counted_a_slice_per_turn(
    tmp_path: Path,
) -> None:
    """`shoal_frontend_live_instances` counted every model's and every virtual model's live
    instances in one turn of the loop (a set per virtual model over its targets' instances:
    16-18 ms at 10,000 routes, 61 ms at 30,000), at each scrape and each reconciliation.
    Now each is counted when its slice is written: counted here in reads per turn."""
    frontend = Frontend(FrontendConfig(port=0, cache_dir=tmp_path))
    models = RENDER_SLICE * 12
    for i in range(models):
        frontend.registry.join(fleet_instance(i + 1, f"model-{i:05d}"))
        route = Route(workspace="default", name=f"vm-{i:05d}",
                      targets=(FleetTarget(f"model-{i:05d}"), FleetTarget(f"model-{i + 1:05d}")))  # fmt: skip
        frontend.routes.put(route.key, route.to_json())
    shadow = Route(workspace="default", name="model-00007",
                   targets=(FleetTarget("model-00001"), FleetTarget("model-00002")))  # fmt: skip
    frontend.routes.put(shadow.key, shadow.to_json())  # (a virtual model wins a name)
    reads = CountedPerTurn(Model, VirtualModel, name="live_instances")
    pieces = await frontend.metrics.render_sliced()
    worst = reads.stop()
    assert worst <= RENDER_SLICE, f"{worst:,} models' live instances counted in one turn"
    text = b"".join(pieces).decode()
    lines = [x for x in text.splitlines() if x.startswith("shoal_frontend_live_instances{")]
    expected = sorted(
        [f"model-{i:05d}" for i in range(models)] + [f"vm-{i:05d}" for i in range(models)]
    )
    assert labels(text, "shoal_frontend_live_instances") == expected
    assert 'shoal_frontend_live_instances{model="vm-00003"} 2.0' in lines
    assert f'shoal_frontend_live_instances{{model="vm-{models - 1:05d}"}} 1.0' in lines
    assert 'shoal_frontend_live_instances{model="model-00007"} 2.0' in lines
    reads = CountedPerTurn(Model, VirtualModel, name="live_instances")
    await frontend.metrics.drop_departed_sliced()  # (each reconciliation: names, no counts)
    assert reads.stop() == 0
    frontend.routes.close()
    frontend.registry.close()
