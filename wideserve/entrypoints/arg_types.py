"""argparse value types that both flag modules use, the engine flags (engine_args.py) and the
data-parallel flags (distributed/args.py): a module of their own so that neither flag module
imports the other. argparse only: every `wideserve` call imports this
(tests/entrypoints/test_cli_help.py)."""
from __future__ import annotations

import argparse


def parse_positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
