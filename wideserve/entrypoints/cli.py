"""The `wideserve` command: one subcommand per module.

Each module in SUBCOMMANDS exposes `add_parser(subparsers) -> argparse.ArgumentParser` and
`run(args) -> int` (the exit status). Only the module of the subcommand on the command line is
imported (`wideserve serve --help` never loads the others); `wideserve --help` lists them
from the one-line summaries below. Keep those modules cheap to import (argparse only at module
level; torch, numpy, fastapi and the engine inside `run`): tests/entrypoints/test_cli_help.py
checks that `--help` imports none of them.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line summary shown by `wideserve --help`)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "info": ("wideserve.entrypoints.info",
             "describe a model: parameters, layer schedule, KV bytes per token; --plan sizes "
             "a deployment"),
    "generate": ("wideserve.entrypoints.generate", "generate text for one or more prompts"),
    "serve": ("wideserve.entrypoints.serve", "run the OpenAI-compatible server"),
    "bench": ("wideserve.entrypoints.bench", "benchmarks (throughput, serve, gen-agentic)"),
    "router": ("wideserve.entrypoints.router",
               "proxy requests over prefill and decode instances (P/D)"),
    "simulate": ("wideserve.entrypoints.simulate",
                 "rack simulator: predict a DEP/EPLB/P/D/MTP deployment; sweep; calibrate"),
}


def _requested(argv: list[str]) -> str | None:
    """The subcommand named on the command line (its first non-option word), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in SUBCOMMANDS else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The full parser of the subcommand in `argv` (all of them when `argv` is None); the
    others get a stub that carries only their summary."""
    parser = argparse.ArgumentParser(
        prog="wideserve", description="Serve DeepSeek-V4-family MoE models "
        "(docs: README.md; `wideserve COMMAND --help` for a command's flags).")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = _requested(argv) if argv is not None else None
    for name, (module_name, summary) in SUBCOMMANDS.items():
        if argv is not None and name != wanted:
            subparsers.add_parser(name, help=summary, add_help=False)
            continue
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
