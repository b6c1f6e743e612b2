"""`shoal.cli.common`: a flag falls back to `SHOAL_<NAME>`, then to its default, and a ready
line reads back as the fields it was printed with."""

from __future__ import annotations

import argparse
import asyncio
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.cli.common import add_flag, number, parse_ready_line, ready_line
from shoal.cli.main import build_parser
from tests.processes import Processes


def parser_with_flags() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flag(parser, "--port", 8000, type=number(int, low=0, high=65535))
    add_flag(parser, "--store")
    add_flag(parser, "--db", env="catalog_db")
    add_flag(parser, "--workspace", "default", short="-w")
    add_flag(parser, "--public-read", action="store_true")
    add_flag(parser, "--api-key", action="append")
    return parser


def test_flags_without_environment_take_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PORT", "STORE", "CATALOG_DB", "WORKSPACE", "PUBLIC_READ", "API_KEY"):
        monkeypatch.delenv(f"SHOAL_{name}", raising=False)
    args = parser_with_flags().parse_args([])
    assert (args.port, args.store, args.db, args.workspace) == (8000, None, None, "default")
    assert (args.public_read, args.api_key) == (False, [])


def test_flags_fall_back_to_the_environment_and_the_command_line_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHOAL_PORT", "9000")
    monkeypatch.setenv("SHOAL_STORE", "memory://x")
    monkeypatch.setenv("SHOAL_CATALOG_DB", "sqlite:///c.db")
    monkeypatch.setenv("SHOAL_WORKSPACE", "team")
    monkeypatch.setenv("SHOAL_PUBLIC_READ", "Yes")
    monkeypatch.setenv("SHOAL_API_KEY", "a,b")
    parser = parser_with_flags()
    args = parser.parse_args([])
    assert (args.port, args.store, args.db, args.workspace) == (
        9000,
        "memory://x",
        "sqlite:///c.db",
        "team",
    )
    assert (args.public_read, args.api_key) == (True, ["a", "b"])
    args = parser.parse_args(["--port", "1", "-w", "mine", "--api-key", "c"])
    assert (args.port, args.workspace, args.api_key) == (1, "mine", ["a", "b", "c"])


def test_an_empty_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_PORT", "")
    monkeypatch.setenv("SHOAL_PUBLIC_READ", "")
    args = parser_with_flags().parse_args([])
    assert (args.port, args.public_read) == (8000, False)


def test_a_bad_environment_value_is_a_usage_error_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHOAL_PORT", "many")
    with pytest.raises(argparse.ArgumentError, match="--port"):
        parser_with_flags().parse_args([])


def test_a_ready_line_reads_back_as_its_fields() -> None:
    fields = {"model": "a,b", "url": "http://127.0.0.1:1", "instance": "7f"}
    line = ready_line("worker", **fields)
    assert line == "shoal worker ready: model=a,b url=http://127.0.0.1:1 instance=7f"
    assert parse_ready_line(line + "\n", "worker") == fields
    assert parse_ready_line(line) == fields


def test_a_value_with_spaces_reads_back_whole() -> None:
    db = "sqlite:////Users/me/Library/Application Support/shoal/catalog.db"
    line = ready_line("catalog", url="http://h:8100", db=db)
    assert parse_ready_line(line, "catalog") == {"url": "http://h:8100", "db": db}


@pytest.mark.parametrize(
    "line", ["shoal frontend ready: url=http://h:1", "shoal worker: cannot serve", "ready: url=x"]
)
def test_other_lines_are_not_a_worker_ready_line(line: str) -> None:
    assert parse_ready_line(line, "worker") is None


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["worker", "--drain-timeout", "nan"], "--drain-timeout"),
        (["worker", "--lease-ttl", "nan"], "--lease-ttl"),
        (["worker", "--lease-ttl", "inf"], "--lease-ttl"),
        (["worker", "--lease-ttl", "0"], "--lease-ttl"),
        (["worker", "--port", "75276"], "--port"),
        (["worker", "--status-port", "75276"], "--status-port"),
        (["worker", "--kv-events-port", "-1"], "--kv-events-port"),
        (["worker", "--speedup", "nan"], "--speedup"),
        (["worker", "--max-seqs", "0"], "--max-seqs"),
        (["frontend", "--port", "75276"], "--port"),
        (["frontend", "--drain-timeout", "nan"], "--drain-timeout"),
        (["frontend", "--first-byte-timeout", "-inf"], "--first-byte-timeout"),
        (["up", "--workers", "-1"], "--workers"),
        (["up", "--catalog-port", "70000"], "--catalog-port"),
        (["catalog", "serve", "--port", "70000"], "--port"),
        (["worker", "--port", "9" * 400], "--port"),  # past a float: OverflowError
        (["worker", "--max-seqs", "9" * 400], "--max-seqs"),
        (["worker", "--max-seqs", "9" * 5000], "--max-seqs"),  # past int()'s digit limit
    ],
)
def test_non_finite_and_out_of_range_numeric_flags_are_one_line_usage_errors(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(argv)
    assert caught.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"argument {named}" in errors[0], errors
    assert "Traceback" not in errors[0]
    assert len(errors[0]) < 300, "a huge value is not echoed whole"


def test_an_out_of_range_environment_value_is_refused_like_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHOAL_PORT", "75276")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker"])
    assert "argument --port" in capsys.readouterr().err


def test_every_numeric_flag_of_every_command_goes_through_the_one_validator() -> None:
    def actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from actions(sub)
            else:
                yield action

    numeric = [a for a in actions(build_parser()) if a.type in (int, float)]
    assert numeric == []
    with pytest.raises(TypeError, match="--n"):
        add_flag(argparse.ArgumentParser(), "--n", 1, type=int)


def test_number_names_what_it_wants() -> None:
    port = number(int, low=0, high=65535)
    assert port("8080") == 8080
    for bad, said in (("75276", "at most 65535"), ("-1", "at least 0"), ("x", "integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            port(bad)
    seconds = number(float, above=0)
    assert seconds("0.5") == 0.5
    for bad, said in (("nan", "finite"), ("inf", "finite"), ("0", "more than 0")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            seconds(bad)


def test_a_subcommand_imports_only_its_own_module() -> None:
    """`shoal frontend` builds only the frontend's parser: the catalog's modules (its
    database and web framework) are not imported on the way to serving."""
    import subprocess
    import sys

    code = (
        "import sys; from shoal.cli.main import build_parser; "
        "args = build_parser(['--log-level', 'DEBUG', 'frontend']).parse_args("
        "['--log-level', 'DEBUG', 'frontend']); "
        "print(args.command, 'shoal.cli.catalog' in sys.modules, 'shoal.cli.up' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["frontend", "False", "False"]
    # With no subcommand named (`shoal --help`), every subcommand is there.
    from shoal.cli.main import COMMANDS, build_parser

    help_text = build_parser([]).format_help()
    assert all(command in help_text for command in COMMANDS)


async def test_a_shoal_process_raises_its_open_file_limit_to_the_hard_one(
    processes: Processes, tmp_path: Path
) -> None:
    """A frontend started under a soft limit of open files below the hard one (1,024 under
    hundreds of thousands, as distributions start processes) ran out of descriptors at
    a few thousand clients and KV subscriptions; every shoal command raises it at start."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 4096, hard - 1) if hard != resource.RLIM_INFINITY else min(soft, 4096)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # (the child inherits it)
    try:
        front = await processes.start(
            "frontend", "--store", f"sqlite:///{tmp_path / 'store.db'}", "--port", "0",
            "--cache-dir", str(tmp_path / "cache"), ready="frontend",
        )  # fmt: skip
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    limits = (
        await asyncio.to_thread(Path(f"/proc/{front.proc.pid}/limits").read_text)
    ).splitlines()
    (line,) = [line for line in limits if line.startswith("Max open files")]
    child_soft, child_hard = line.split()[3:5]
    assert child_soft == child_hard, line
