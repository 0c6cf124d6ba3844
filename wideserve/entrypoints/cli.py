"""The `wideserve` command: one subcommand per module.

Each module in SUBCOMMANDS exposes `add_parser(subparsers) -> argparse.ArgumentParser` and
`run(args) -> int` (the exit status). Keep those modules cheap to import (argparse only at
module level, heavy imports inside `run`): every invocation builds every subparser.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: tuple[str, ...] = (
    "wideserve.entrypoints.info",
    "wideserve.entrypoints.generate",
    "wideserve.entrypoints.serve",
    "wideserve.entrypoints.bench",
    "wideserve.entrypoints.router",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wideserve", description="Serve DeepSeek-V4-family MoE models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMANDS:
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
