"""The compiled build (`HATCH_BUILD_HOOK_ENABLE_MYPYC=true pip install .`, docs/operations.md):
the request path's modules compiled with mypyc serve as the pure-Python ones do.

Built once from a copy of the sources (a build in place leaves the compiled modules beside
the sources every other test imports), installed into a directory of its own, and judged by
the request path's own tests run again on it, in a process whose `shoal` is the compiled one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The request path's tests, run again on the compiled build. Left out: tests that replace a
# method of a compiled class (`monkeypatch.setattr(Upstream, ...)`) or make one without its
# `__init__` (`Upstream.__new__`), which compiled classes do not allow, by design.
AGAIN = (
    "tests/frontend/test_proxy.py",
    "tests/frontend/test_server.py",
    "tests/frontend/test_auth_before_body.py",
    "tests/frontend/test_tls_connections.py",
    "tests/frontend/test_upstream_protocol.py",
    "tests/frontend/test_upstream_stalls.py",
    "tests/frontend/test_migration.py",
    "tests/frontend/test_migration_splice.py",
    "tests/frontend/test_disagg_e2e.py",
    "tests/frontend/test_disagg_faults.py",
    "tests/frontend/test_large_bodies.py",
    "tests/frontend/test_keys_stream_usage.py",  # (`Proxy.ask_usage`, `Request.rewrite`)
    "tests/frontend/test_keys_stream_usage_framing.py",  # (`Proxy.ask_usage`: HTTP/1.0)
    # (a compiled coroutine keeps what it held after it ends: reference cycles of its own)
    "tests/frontend/test_request_garbage.py",
    "tests/frontend/test_request_garbage_stages.py",
    "tests/frontend/test_request_garbage_paths.py",
)


def compiled_modules() -> list[str]:
    """The modules the build compiles, as `pyproject.toml` names them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    hook = config["tool"]["hatch"]["build"]["targets"]["wheel"]["hooks"]["mypyc"]
    return [p.removeprefix("/src/").removesuffix(".py").replace("/", ".") for p in hook["include"]]


def run(*argv: str, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{argv[:4]} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    return done.stdout


@pytest.fixture(scope="module")
def compiled_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the compiled build of `shoal` (for PYTHONPATH)."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: the compiled build is optional")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers (python3-dev) here: the compiled build is optional")
    tmp = tmp_path_factory.mktemp("compiled")
    tree = tmp / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    skipped = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    shutil.copytree(ROOT / "src", tree / "src", ignore=skipped)
    env = {**os.environ, "HATCH_BUILD_HOOK_ENABLE_MYPYC": "true"}
    pip = (sys.executable, "-m", "pip", "--disable-pip-version-check")
    run(*pip, "wheel", str(tree), "--no-deps", "-w", str(tmp / "wheel"), env=env)
    (wheel,) = (tmp / "wheel").glob("shoal-*.whl")
    run(*pip, "install", "--no-deps", "--target", str(tmp / "site"), str(wheel))
    return tmp / "site"


def on(site: Path) -> dict[str, str]:
    """The environment of a process whose `shoal` is the one in `site`."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


# One test, so that pytest-xdist builds once (a module's fixture is built again by each
# worker that takes one of its tests): about a minute to build, one to run the tests again.
@pytest.mark.timeout(1200)
def test_the_compiled_build_compiles_the_request_path_and_serves_as_the_python_one(
    compiled_site: Path,
) -> None:
    env = on(compiled_site)
    # The request path's modules are compiled; the rest is the same Python.
    modules = compiled_modules()
    assert "shoal.frontend.http.server" in modules and "shoal.frontend.proxy.forward" in modules
    probe = (
        "import importlib, sys\nfor m in sys.argv[1:]: print(importlib.import_module(m).__file__)"
    )
    others = ["shoal.frontend.proxy.fields", "shoal.frontend.app"]
    files = run(sys.executable, "-c", probe, *modules, *others, env=env).split()
    assert len(files) == len(modules) + len(others)
    for module, file in zip(modules, files, strict=False):
        assert file.startswith(str(compiled_site)) and file.endswith(".so"), (module, file)
    for module, file in zip(others, files[len(modules) :], strict=True):
        assert file.startswith(str(compiled_site)) and file.endswith(".py"), (module, file)
    # `bench.request_path` checks every answer it serves: complete, pooled, counted.
    out = run(
        sys.executable, "-m", "bench.request_path", "--requests", "300", "--repeat", "1",
        "--json", env=env, timeout=300,
    )  # fmt: skip
    assert '"plain"' in out and '"stream"' in out, out
    # The request path's own tests, on the compiled build.
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_XDIST")}
    out = run(
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *AGAIN,
        env=env, timeout=900,
    )  # fmt: skip
    assert " passed" in out and "failed" not in out, out[-2000:]
