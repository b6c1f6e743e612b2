"""`shoal worker --kv-events-format`: the flag, else `SHOAL_KV_EVENTS_FORMAT`, else `array`,
reaches the engine's KV publisher; anything else is a usage error."""

from __future__ import annotations

import pytest

from shoal.cli.main import build_parser
from shoal.cli.worker import make_engine
from shoal.worker.engines.mocker import MockerEngine

WORKER = ["worker", "--model", "m", "--kv-events-port", "0"]


def wire_format(argv: list[str]) -> str:
    engine = make_engine(build_parser().parse_args([*WORKER, *argv]))
    assert isinstance(engine, MockerEngine) and engine.publisher is not None
    return engine.publisher.wire_format


def test_the_kv_events_format_is_the_flag_else_the_environment_else_array(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SHOAL_KV_EVENTS_FORMAT", raising=False)
    assert wire_format([]) == "array"
    assert wire_format(["--kv-events-format", "map"]) == "map"
    monkeypatch.setenv("SHOAL_KV_EVENTS_FORMAT", "map")
    assert wire_format([]) == "map"
    assert wire_format(["--kv-events-format", "array"]) == "array"


def test_an_unknown_kv_events_format_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SHOAL_KV_EVENTS_FORMAT", raising=False)
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*WORKER, "--kv-events-format", "json"])
    assert exited.value.code == 2
    assert "--kv-events-format" in capsys.readouterr().err
