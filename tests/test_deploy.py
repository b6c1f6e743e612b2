"""`deploy/`: the Grafana dashboard queries only metrics shoal exports, and every Kubernetes
manifest parses and runs `shoal` command lines that the real argument parser accepts.

The exported metrics are read from the `/metrics` of a real `shoal frontend` and a real
`shoal worker` (mocker engine) after a request went through them, so a renamed metric fails
here; the command lines go through `shoal.cli.main.build_parser()`, so a renamed flag does.
"""

from __future__ import annotations

import argparse
import json
import re
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from shoal.cli.main import COMMANDS, build_parser
from tests.helpers import wait_for
from tests.processes import Processes

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "grafana" / "shoal.json"
KUBERNETES = ROOT / "deploy" / "kubernetes"
OPERATIONS = ROOT / "docs" / "operations.md"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
FAST = ("--lease-ttl", "2", "--ttft-ms", "5", "--itl-ms", "2")

# -- Grafana ---------------------------------------------------------------------------------

SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{")
SHOAL_NAME = re.compile(r"\bshoal_[a-z0-9_]+")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(GRAFANA.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
    return queries


def exported_names(text: str) -> set[str]:
    """Every series name a `/metrics` text can carry, including families with no sample yet."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def test_grafana_dashboard_is_importable_and_each_panel_uses_the_datasource_variable() -> None:
    dashboard = json.loads(GRAFANA.read_text())
    assert dashboard["uid"] and dashboard["title"] == "shoal"
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names[0] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


async def test_every_metric_the_grafana_dashboard_queries_is_exported_by_shoal(
    processes: Processes, tmp_path: Path
) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    namespace = f"grafana-{uuid.uuid4().hex[:8]}"
    worker = await processes.worker(store_url, "--namespace", namespace, *FAST)
    frontend = await processes.start(
        "frontend", "--store", store_url, "--port", "0", "--namespace", namespace,
        ready="frontend",
    )  # fmt: skip
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0)
    async with client:
        await wait_for(lambda: _lists(client, worker.model), timeout=20)
        stream = await client.chat.completions.create(
            model=worker.model, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for _ in stream:
            pass
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
    exported: set[str] = set()
    async with aiohttp.ClientSession() as session:
        for url in (f"{frontend.url}/metrics", f"{worker.status_url}/metrics"):
            async with session.get(url) as response:
                assert response.status == 200
                exported |= exported_names(await response.text())

    queries = dashboard_queries()
    selected = {name for q in queries for name in SELECTOR.findall(q)}
    assert all(name.startswith("shoal_") for name in selected), selected
    queried = selected | {name for q in queries for name in SHOAL_NAME.findall(q)}
    assert not queried - exported, (
        f"the dashboard queries metrics shoal does not export: {sorted(queried - exported)}"
    )
    # Each area the dashboard promises is there.
    for name in (
        "shoal_frontend_requests_total",
        "shoal_frontend_time_to_first_token_seconds_bucket",
        "shoal_frontend_request_duration_seconds_bucket",
        "shoal_frontend_retries_total",
        "shoal_frontend_instances_inhibited_total",
        "shoal_frontend_reconcile_runs_total",
        "shoal_frontend_reconcile_repairs_total",
        "shoal_loop_healthy",
        "shoal_worker_requests_total",
        "shoal_worker_lease_held",
    ):
        assert name in queried, f"the dashboard does not show {name}"


async def _lists(client: openai.AsyncOpenAI, model: str) -> bool:
    return model in [m.id async for m in client.models.list()]


# -- Kubernetes ------------------------------------------------------------------------------


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) for every document of every manifest."""
    docs: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{name}:{doc['metadata']['name']}", doc["spec"]["template"]["spec"])
        for name, doc in manifests()
        if doc["kind"] in WORKLOADS
    ]


def containers() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{where}/{c['name']}", c)
        for where, spec in pod_specs()
        for c in spec.get("initContainers", []) + spec["containers"]
    ]


def command_line(container: dict[str, Any]) -> list[str]:
    """The container's argv, with `$(VAR)` replaced as the kubelet does (fields: a placeholder)."""
    env = {
        e["name"]: e.get("value", f"placeholder-{e['name'].lower()}")
        for e in container.get("env", [])
    }
    argv = [str(a) for a in container.get("command", []) + container.get("args", [])]
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), a) for a in argv]


SHOAL_CONTAINERS = [(n, c) for n, c in containers() if command_line(c)[:1] == ["shoal"]]


def strict_parser() -> argparse.ArgumentParser:
    """`shoal`'s parser with abbreviations off: a renamed flag must not pass as a prefix."""
    parser = build_parser()
    pending = [parser]
    while pending:
        current = pending.pop()
        current.allow_abbrev = False
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    return parser


def check_command_line(argv: list[str]) -> argparse.Namespace:
    """Parse `argv` (starting with `shoal`) as the real command would, or fail naming it."""
    assert argv[0] == "shoal"
    try:
        return strict_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"`{' '.join(argv)}` is refused by the shoal argument parser (see stderr)")


def test_manifests_run_shoal_in_the_frontend_catalog_relay_and_both_workers() -> None:
    subcommands = {(n.split(":")[0], command_line(c)[1]) for n, c in SHOAL_CONTAINERS}
    assert subcommands == {
        ("catalog.yaml", "catalog"),
        ("frontend.yaml", "frontend"),
        ("kv-relay.yaml", "kv-relay"),
        ("worker-mocker.yaml", "worker"),
        ("worker-vllm.yaml", "worker"),
    }


@pytest.mark.parametrize(
    "container", [c for _, c in SHOAL_CONTAINERS], ids=[n for n, _ in SHOAL_CONTAINERS]
)
def test_each_shoal_container_command_line_is_accepted_by_the_real_parser(
    container: dict[str, Any],
) -> None:
    argv = command_line(container)
    if argv[1] not in COMMANDS:
        pytest.skip(
            f"`shoal {argv[1]}` is not registered in this build (shoal.cli.main.COMMANDS): "
            "its command line cannot be checked until it is"
        )
    args = check_command_line(argv)
    assert args.command == argv[1]


def test_a_renamed_flag_fails_the_command_line_check() -> None:
    with pytest.raises(pytest.fail.Exception, match="refused"):
        check_command_line(["shoal", "frontend", "--store=memory://x", "--drain-timeot=5"])
    with pytest.raises(pytest.fail.Exception, match="refused"):  # no prefix matching either
        check_command_line(["shoal", "frontend", "--drain=5"])


def test_the_vllm_example_puts_the_openai_sidecar_next_to_vllm() -> None:
    ((_, spec),) = [(w, s) for w, s in pod_specs() if "worker-vllm" in w]
    names = [c["name"] for c in spec["containers"]]
    assert names == ["vllm", "shoal"]
    vllm, sidecar = spec["containers"]
    argv = command_line(sidecar)
    assert "--engine=openai" in argv
    port = next(a.split("=", 1)[1] for a in vllm["args"] if a.startswith("--port="))
    assert f"--upstream=http://127.0.0.1:{port}/v1" in argv


def test_probes_name_declared_ports_and_documented_paths() -> None:
    documented = OPERATIONS.read_text() if OPERATIONS.exists() else None
    for name, container in containers():
        ports = {p.get("name") for p in container.get("ports", [])}
        ports |= {p["containerPort"] for p in container.get("ports", [])}
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            target = probe.get("httpGet") or probe.get("tcpSocket")
            if target is not None:
                assert target["port"] in ports, f"{name} {kind}: port {target['port']} undeclared"
            if probe.get("httpGet") and command_line(container)[:1] == ["shoal"]:
                path = probe["httpGet"]["path"]
                assert path in ("/live", "/ready", "/health"), f"{name} {kind}: {path}"
                if documented is not None:
                    assert f"GET {path}" in documented, f"{name} {kind}: {path} not documented"
    frontend = dict(containers())["frontend.yaml:shoal-frontend/frontend"]
    assert frontend["livenessProbe"]["httpGet"]["path"] == "/live"
    assert frontend["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_the_catalog_runs_its_models_controller_on_two_replicas_with_http_probes() -> None:
    """Without `--store` no controller runs (no routes, no deployments); the readiness probe
    is the controller's health; two replicas share the leadership."""
    workloads = [d for n, d in manifests() if n == "catalog.yaml" and d["kind"] in WORKLOADS]
    assert [d["spec"]["replicas"] for d in workloads] == [2]
    catalog = dict(containers())["catalog.yaml:shoal-catalog/catalog"]
    args = check_command_line(command_line(catalog))
    assert args.store and args.store.startswith("etcd://")
    assert catalog["livenessProbe"]["httpGet"]["path"] == "/live"
    assert catalog["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_services_select_pods_and_secrets_referenced_exist() -> None:
    docs = manifests()
    templates = [
        doc["spec"]["template"]["metadata"]["labels"] for _, doc in docs if doc["kind"] in WORKLOADS
    ]
    for name, doc in docs:
        if doc["kind"] == "Service":
            selector = doc["spec"]["selector"]
            assert any(selector.items() <= labels.items() for labels in templates), (name, selector)
    secrets = {
        doc["metadata"]["name"]: set(doc.get("stringData", {})) | set(doc.get("data", {}))
        for _, doc in docs
        if doc["kind"] == "Secret"
    }
    for name, container in containers():
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["key"] in secrets.get(ref["name"], set()), f"{name}: {ref}"
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    on_disk = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == on_disk
