"""argparse value types (a bad value is a one-line error naming the flag) for every module that
defines flags: the engine flags (engine_args.py), the data-parallel flags (entrypoints/parallel_args.py)
and the server's. A module of its own so that flag modules need not import each other.
argparse only at import: every `wideserve` call imports this
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


def parse_positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def parse_port(text: str) -> int:
    value = parse_positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [1, 65535], got {text!r}")
    return value


def parse_bytes(text: str) -> int:
    """'8589934592', '8GiB', '512MB', '4g' -> bytes."""
    from wideserve.config import parse_size
    try:
        return parse_size(text, "value")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None
