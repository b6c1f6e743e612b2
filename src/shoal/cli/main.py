"""The `shoal` command. Thin: parses flags, calls the layers.

Each subcommand lives in its own module with `add_parser(subparsers)` and `run(args) -> int`.
Every flag falls back to an environment variable `SHOAL_<NAME>`, then to a laptop default
(`shoal.cli.common.add_flag`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from shoal.cli.common import add_flag

COMMANDS = {
    "up": "shoal.cli.up",
    "frontend": "shoal.cli.frontend",
    "worker": "shoal.cli.worker",
    "ls": "shoal.cli.ls",
    "catalog": "shoal.cli.catalog",
    "kv-relay": "shoal.cli.relay",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; or, when `argv` names one, of that one only: each
    subcommand's module imports its layers (a frontend's start need not import the catalog's
    database and web framework, ~0.4 s of CPU)."""
    parser = argparse.ArgumentParser(
        prog="shoal", description="Serve LLMs on a fleet of workers behind one OpenAI endpoint."
    )
    add_flag(parser, "--log-level", "INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = None if argv is None else _command_named(argv)
    for command, module in COMMANDS.items():
        if named is None or command == named:
            importlib.import_module(module).add_parser(sub)
    return parser


def _command_named(argv: list[str]) -> str | None:
    """The subcommand `argv` names (its first word that is neither an option nor the value
    of `--log-level`), if it is one of `COMMANDS`."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code: int = importlib.import_module(COMMANDS[args.command]).run(args)
    except BrokenPipeError:  # `shoal ls | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
