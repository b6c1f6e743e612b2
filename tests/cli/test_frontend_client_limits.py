"""The client-limit and CORS flags of `shoal frontend`: defaults, `SHOAL_<NAME>` fallbacks,
and values refused before the gateway starts."""

from __future__ import annotations

import pytest

from shoal.cli.frontend import config_from_args
from shoal.cli.main import build_parser

NAMES = ("HEADER_TIMEOUT", "BODY_TIMEOUT", "MAX_CONNECTIONS", "MAX_HEADER_SIZE", "MAX_HEADERS",
         "CORS_ORIGIN", "MAX_BODY_MEMORY")  # fmt: skip


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NAMES:
        monkeypatch.delenv(f"SHOAL_{name}", raising=False)


def test_client_limits_have_defaults_and_cors_is_off() -> None:
    config = config_from_args(build_parser().parse_args(["frontend"]))
    assert (config.header_timeout, config.body_timeout) == (10.0, 30.0)
    assert (config.max_connections, config.max_header_size, config.max_headers) == (
        10_000, 65_536, 100,
    )  # fmt: skip
    assert config.max_body_memory == 1 << 30
    assert config.cors_origins == ()


def test_client_limits_fall_back_to_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    values = ("2.5", "0", "50", "4096", "20", "https://a.example,https://b.example", "33554432")
    for name, value in zip(NAMES, values, strict=True):
        monkeypatch.setenv(f"SHOAL_{name}", value)
    config = config_from_args(build_parser().parse_args(["frontend"]))
    assert (config.header_timeout, config.body_timeout) == (2.5, 0.0)
    assert (config.max_connections, config.max_header_size, config.max_headers) == (50, 4096, 20)
    assert config.cors_origins == ("https://a.example", "https://b.example")
    assert config.max_body_memory == 32 << 20


def test_cors_origin_is_repeatable() -> None:
    args = ["frontend", "--cors-origin", "https://a.example", "--cors-origin", "*"]
    assert config_from_args(build_parser().parse_args(args)).cors_origins == (
        "https://a.example", "*",
    )  # fmt: skip


@pytest.mark.parametrize(
    "flag, value",
    [("--header-timeout", "-1"), ("--body-timeout", "-0.5"), ("--max-connections", "0"),
     ("--max-header-size", "0"), ("--max-headers", "0")],
)  # fmt: skip
def test_bad_client_limits_are_refused_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["frontend", flag, value])
    assert f"argument {flag}:" in capsys.readouterr().err


def test_a_body_memory_below_the_largest_body_is_refused_naming_both_flags() -> None:
    """`--max-body-memory 1048576` beside the default `--max-body` (16 MiB) started: every
    request with a body over 1 MiB was then answered 503 `server_busy`, 'retry shortly', on
    an idle frontend, for good (a client retrying a 503 retried in vain). Refused at start."""
    args = build_parser().parse_args(["frontend", "--max-body-memory", "1048576"])
    with pytest.raises(ValueError, match="--max-body-memory") as refused:
        config_from_args(args)
    assert "--max-body" in str(refused.value) and "16777216" in str(refused.value)
    same = ["frontend", "--max-body-memory", "1048576", "--max-body", "1048576"]
    assert config_from_args(build_parser().parse_args(same)).max_body_memory == 1 << 20
