"""Free TCP ports for the tests' servers and process groups.

The old way (bind port 0, read the number, close, start a server on it seconds later) races on
a loaded machine: port 0 hands out a port of the kernel's ephemeral range, and until the
server binds it, any process on the machine (another xdist worker's HTTP client, a gloo
rendezvous, a NIXL listener) may be given the same port by the kernel. The ports handed out
here lie outside that range, where the kernel never assigns one on its own: only a process
that asks for that very number can take it, and each is checked free (no listener, no
connection, no TIME_WAIT on any address) before it is returned.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 20000                      # below: well-known and registered services
_EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()        # this process's: never the same port twice
# Not the global `random`: a test that seeds it would make every xdist worker draw the same
# ports in the same order.
_rng = random.SystemRandom()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = map(int, _EPHEMERAL_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999          # Linux's default


def _pool() -> range:
    """Ports the kernel never hands out by itself: below the ephemeral range (or above it,
    where the range starts too low to leave room below)."""
    lo, hi = _ephemeral_range()
    if lo - _LOWEST >= 2000:
        return range(_LOWEST, lo)
    return range(hi + 1, 65536)


def _is_free(port: int) -> bool:
    """Bindable on every address without SO_REUSEADDR: nothing listens on it, uses it for a
    connection or holds it in TIME_WAIT."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port_block(n: int = 1, attempts: int = 500) -> int:
    """A base port with base .. base + n - 1 all free right now, outside the ephemeral range
    (so they stay free until the test binds them, unless it hands them out itself)."""
    pool = _pool()
    for _ in range(attempts):
        base = _rng.randrange(pool.start, pool.stop - n + 1)
        block = range(base, base + n)
        if _handed_out.intersection(block) or not all(_is_free(p) for p in block):
            continue
        _handed_out.update(block)
        return base
    raise RuntimeError(f"no block of {n} free ports in {pool.start}-{pool.stop - 1}")


def free_port() -> int:
    return free_port_block(1)
