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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal", description="Serve LLMs on a fleet of workers behind one OpenAI endpoint."
    )
    add_flag(parser, "--log-level", "INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
