"""The layers of DESIGN.md hold in the code: every import between shoal's packages points
down (or within its own package), the layer-5 packages never import each other, and no
module imports itself through others (no cycle, counting imports made only for type checks).
"""

from __future__ import annotations

import grimp
import pytest

LAYERS = {
    "shoal.bounds": 0,  # bounds on outside values (nesting depth): used by every layer
    "shoal.store": 1,
    "shoal.cards": 2,
    "shoal.openai": 2,
    "shoal.kv": 2,
    "shoal.discovery": 3,
    "shoal.controllers": 4,
    "shoal.worker": 5,
    "shoal.frontend": 5,
    "shoal.membership": 5,
    "shoal.catalog": 6,
    "shoal.relay": 6,
    "shoal.cli": 7,
}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("shoal", cache_dir=None)


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and ".".join(parts[:2]) in LAYERS else None


def test_every_package_of_shoal_has_a_layer(graph: grimp.ImportGraph) -> None:
    packages = {".".join(m.split(".")[:2]) for m in graph.modules if m.count(".") >= 1}
    assert packages <= set(LAYERS), (
        f"packages missing from DESIGN.md's layers: {packages - set(LAYERS)}"
    )


def test_imports_point_down_the_layers_and_layer_5_packages_stay_apart(
    graph: grimp.ImportGraph,
) -> None:
    wrong: list[str] = []
    for importer in sorted(graph.modules):
        source = package_of(importer)
        if source is None:
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            target = package_of(imported)
            if target is None or target == source:
                continue
            upward = LAYERS[target] > LAYERS[source]
            sideways = LAYERS[target] == LAYERS[source] == 5
            if upward or sideways:
                wrong.append(
                    f"{importer} -> {imported} (layer {LAYERS[source]} -> {LAYERS[target]})"
                )
    assert wrong == []


def test_no_module_imports_itself_through_others(graph: grimp.ImportGraph) -> None:
    cycles: set[tuple[str, ...]] = set()
    for importer in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(importer):
            if imported.startswith(importer + "."):
                continue  # a package importing its own submodule (its __init__) is no cycle
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None and not importer.startswith(imported + "."):
                cycles.add(tuple(sorted((importer, *back))))
    assert sorted(cycles) == []
