"""`shoal frontend` scope flags: one way to choose the scope, rules refused naming them."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.cli.frontend import config_from_args
from shoal.cli.main import build_parser
from shoal.cli.scope import membership_for
from shoal.discovery import Discovery
from shoal.frontend import FrontendConfig
from shoal.membership import DiscoverySource, MembershipWatch, Selection
from shoal.store.memory import MemoryStore


def config(*argv: str) -> FrontendConfig:
    return config_from_args(build_parser().parse_args(["frontend", *argv]))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NAMESPACE", "NAMESPACE_SOURCES", "NAMESPACES_FROM_DISCOVERY", "ENDPOINT_PREFIX"):
        monkeypatch.delenv(f"SHOAL_{name}", raising=False)


def test_scope_flags_and_their_environment_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert membership_for(config()) is None  # fixed namespaces: today's behaviour
    sources = config("--namespace-sources", str(tmp_path / "s.json"))
    assert sources.namespace_sources == tmp_path / "s.json" and membership_for(sources)
    monkeypatch.setenv("SHOAL_NAMESPACES_FROM_DISCOVERY", "true")
    monkeypatch.setenv("SHOAL_ENDPOINT_PREFIX", "a.backend,b")
    from_env = config()
    assert from_env.namespaces_from_discovery
    assert from_env.endpoint_prefixes == ("a.backend", "b")


@pytest.mark.parametrize(
    ("argv", "rule"),
    [
        (["--namespace", "a", "--namespace-sources", "f"], "exclude each other"),
        (["--namespace-sources", "f", "--namespaces-from-discovery"], "exclude each other"),
        (["--endpoint-prefix", "a"], "--endpoint-prefix needs --namespace or --namespaces-"),
        (["--namespace", "a", "--endpoint-prefix", "b.c"], "inside a listed namespace"),
        (["--namespaces-from-discovery", "--endpoint-prefix", "a.b.c.d"], "ns.component"),
        (["--namespaces-from-discovery", "--endpoint-prefix", "a b"], "invalid namespace"),
    ],
)
def test_scope_flags_breaking_a_rule_are_refused_naming_it(argv: list[str], rule: str) -> None:
    with pytest.raises(ValueError) as caught:
        config(*argv)
    assert rule in str(caught.value)


def test_listed_namespaces_with_endpoint_prefixes_follow_discovery() -> None:
    listed = config("--namespace", "a", "--namespace", "b", "--endpoint-prefix", "a.backend")
    build = membership_for(listed)
    assert build is not None
    watch = build(Discovery(MemoryStore()))
    assert isinstance(watch, MembershipWatch)
    source = watch.source
    assert isinstance(source, DiscoverySource)
    assert source.selection == Selection.of(["a", "b"])
    assert [str(p) for p in watch.endpoint_prefixes] == ["a.backend"]
    assert membership_for(config("--namespace", "a")) is None  # no prefixes: fixed, as before


@pytest.mark.parametrize(
    ("argv", "rule"),
    [
        (["--kv-events", "nats://127.0.0.1:4222"], "--kv-events needs --router kv"),
        (["--router", "kv", "--kv-events", "tcp://h:1"], "is not a nats://HOST:PORT URL"),
    ],
)
def test_kv_events_flags_breaking_a_rule_are_refused_naming_it(argv: list[str], rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        config(*argv)


def test_kv_events_reads_the_stream_only_when_asked() -> None:
    assert config("--router", "kv").kv_events is None  # ZMQ stays the default
    asked = config("--router", "kv", "--kv-events", "nats://a:4222,nats://b:4222")
    assert (asked.kv_events, asked.kv_stream) == ("nats://a:4222,nats://b:4222", "shoal-kv")


def test_the_relay_needs_members_and_refuses_what_the_frontend_refuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from shoal.cli import relay

    parse = build_parser().parse_args
    assert relay.run(parse(["kv-relay"])) == 2
    assert "choose the members" in capsys.readouterr().err
    assert relay.run(parse(["kv-relay", "--namespace", "a", "--namespace-sources", "f"])) == 2
    assert "exclude each other" in capsys.readouterr().err
