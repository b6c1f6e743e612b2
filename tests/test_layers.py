"""The layers of DESIGN.md hold in the code: every import between shoal's packages points
down (or within its own package), the layer-5 packages never import each other, and no
module imports itself through others (no cycle, counting imports made only for type checks).
Inside the frontend, its subpackages are layered the same way (docs/architecture.md).
"""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

import shoal.frontend

LAYERS = {
    "shoal.bounds": 0,
    "shoal.slices": 0,  # large JSON arrays decoded on the event loop a slice at a time
    "shoal.full_collections": 0,  # full garbage collections deferred, process-wide
    "shoal.open_files": 0,  # the open-file limit: raised here, given back to children
    "shoal.urls": 0,  # URLs as they may be shown (credentials redacted)  # bounds on outside values (nesting depth): used by every layer
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


# The frontend's subpackages, bottom up; the modules directly in `shoal.frontend` (`app`, the
# package's face) wire them together and sit on top. Subpackages of one layer stay apart.
FRONTEND = "shoal.frontend"
FRONTEND_LAYERS = {
    "shoal.frontend.http": 0,  # the wire: server, upstream connections, errors, CORS
    "shoal.frontend.registry": 1,  # the fleet: registry, watcher, metadata, router, metrics
    "shoal.frontend.keys": 1,  # API keys, limits, metering, usage
    "shoal.frontend.virtual": 2,  # virtual models, routes, provider secrets
    "shoal.frontend.kv": 2,  # KV-aware routing
    "shoal.frontend.proxy": 3,  # the request path, migration, disaggregation
    "shoal.frontend.dashboard": 4,  # /ui
    FRONTEND: 5,  # app: the composition root
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


def frontend_part_of(module: str) -> str | None:
    """The frontend subpackage `module` is in, `shoal.frontend` for the modules directly in
    the frontend package, None outside the frontend."""
    if module != FRONTEND and not module.startswith(FRONTEND + "."):
        return None
    subpackage = ".".join(module.split(".")[:3])
    return subpackage if subpackage in FRONTEND_LAYERS else FRONTEND


def test_every_frontend_subpackage_has_a_layer(graph: grimp.ImportGraph) -> None:
    subpackages = {
        ".".join(m.split(".")[:3]) for m in graph.find_descendants(FRONTEND) if m.count(".") >= 3
    }
    assert subpackages <= set(FRONTEND_LAYERS), (
        f"frontend subpackages missing from FRONTEND_LAYERS: {subpackages - set(FRONTEND_LAYERS)}"
    )


def test_frontend_subpackages_import_down_and_same_layer_ones_stay_apart(
    graph: grimp.ImportGraph,
) -> None:
    wrong: list[str] = []
    for importer in sorted(graph.find_descendants(FRONTEND) | {FRONTEND}):
        source = frontend_part_of(importer)
        assert source is not None
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            target = frontend_part_of(imported)
            if target is None or target == source:
                continue
            if FRONTEND_LAYERS[target] >= FRONTEND_LAYERS[source]:
                wrong.append(
                    f"{importer} -> {imported} "
                    f"(layer {FRONTEND_LAYERS[source]} -> {FRONTEND_LAYERS[target]})"
                )
    assert wrong == []


MAX_FRONTEND_MODULE_LINES = 600


def test_no_frontend_module_is_over_600_lines() -> None:
    """The frontend stays split along its seams: a module that grows past 600 lines holds
    more than one thing (issue 30; `registry/watcher.py` grew to 615 before it was caught)."""
    root = Path(shoal.frontend.__file__).parent
    long = {
        str(path.relative_to(root)): lines
        for path in sorted(root.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_FRONTEND_MODULE_LINES
    }
    assert long == {}
