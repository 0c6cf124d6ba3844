"""tests/ports.py: the ports handed to the tests' servers lie outside the kernel's ephemeral
range (where the kernel gives a port to any process's bind(0) or connect() meanwhile), are
free on every address, and are never handed out twice in one process."""
from __future__ import annotations

import socket

import ports


def test_ports_are_free_and_outside_the_ephemeral_range():
    lo, hi = ports._ephemeral_range()
    bases = [ports.free_port_block(4) for _ in range(20)] + [ports.free_port()]
    handed = [p for b in bases[:-1] for p in range(b, b + 4)] + [bases[-1]]
    assert len(set(handed)) == len(handed)                  # never the same port twice
    assert all(not lo <= p <= hi and p >= 1024 for p in handed), (lo, hi, handed)
    for p in handed[:8]:
        with socket.socket() as s:                         # free on every address
            s.bind(("", p))


def test_a_port_in_use_on_any_address_is_not_free(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))                       # one address only, not listening
        taken = held.getsockname()[1]
        assert not ports._is_free(taken)
        picks = iter([taken, taken])
        monkeypatch.setattr(ports._rng, "randrange", lambda a, b: next(picks))
        try:
            ports.free_port_block(1, attempts=2)
        except RuntimeError as e:
            assert "no block of 1 free ports" in str(e)
        else:
            raise AssertionError("a port in use was handed out")
