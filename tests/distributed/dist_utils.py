"""Helpers for multi-process tests: free ports, spawned ranks with bounded waits, cleanup."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(n: int, attempts: int = 50) -> int:
    """A base port with base .. base + n - 1 all free right now."""
    for _ in range(attempts):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def _entry(fn: Callable[..., Any], rank: int, args: tuple, queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(rank, *args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, args: tuple = (), timeout_s: float = 60.0
              ) -> list[Any]:
    """Run fn(rank, *args) in `world` spawned processes; their results by rank. Every process
    is gone when this returns (killed after the timeout)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, args, queue), daemon=True)
             for r in range(world)]
    results: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout_s)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]
