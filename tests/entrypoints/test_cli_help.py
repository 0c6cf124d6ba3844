"""`wideserve ... --help` stays cheap and complete: it imports neither torch nor the engine
(the reason it used to take seconds), and every flag of every subcommand says what it does."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wideserve.entrypoints import cli

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "fastapi", "uvicorn", "zmq", "transformers",
         "wideserve.engine", "wideserve.worker", "wideserve.models")

_PROBE = """
import json, sys
from wideserve.entrypoints.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
sys.stdout.flush()
print("MODULES=" + json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def _modules_after(argv: list[str]) -> tuple[str, set[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True,
                          text=True, env=env, timeout=120)
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("MODULES="))
    return proc.stdout, set(json.loads(line.removeprefix("MODULES=")))


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"],
                                  ["info", "--help"], ["bench", "throughput", "--help"],
                                  ["bench", "serve", "--help"], ["router", "--help"]])
def test_help_imports_no_heavy_module(argv: list[str]) -> None:
    out, modules = _modules_after(argv)
    assert "usage: wideserve" in out
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY or
                   any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert not heavy, f"`wideserve {' '.join(argv)}` imported {heavy[:10]}"


def test_serve_help_lists_the_engine_and_server_flags() -> None:
    out, _ = _modules_after(["serve", "--help"])
    for flag in ("--max-model-len", "--kv-cache-memory", "--speculative-config",
                 "--data-parallel-size", "--served-model-name", "--port"):
        assert flag in out


def _walk(parser: argparse.ArgumentParser, path: list[str]):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, path + [name])
        else:
            yield path, action


def test_every_flag_has_help_text() -> None:
    missing = [f"{' '.join(path)} {'/'.join(a.option_strings) or a.dest}"
               for path, a in _walk(cli.build_parser(), ["wideserve"])
               if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, missing


def test_only_the_requested_subcommand_is_built() -> None:
    parser = cli.build_parser(["router", "--prefill", "http://a", "--decode", "http://b"])
    args = parser.parse_args(["router", "--prefill", "http://a", "--decode", "http://b"])
    assert args.command == "router" and args.prefill == ["http://a"]
    with pytest.raises(SystemExit):     # a stub: it knows no flags
        parser.parse_args(["serve", "--port", "1"])
