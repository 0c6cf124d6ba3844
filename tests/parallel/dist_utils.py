"""Helpers for multi-process tests: free ports, spawned ranks with bounded waits, cleanup."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

# Outside the kernel's ephemeral range, so nothing else is given them meanwhile
# (tests/ports.py; tests/ is put on the path for scripts that import this module).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ports import free_port, free_port_block  # noqa: E402,F401 - re-exported


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


def engine_children(server_pid: int) -> dict[int, int]:
    """{data-parallel rank: pid} of the engine-core processes a server (or headless
    launcher) started, read from /proc (no psutil)."""
    from pathlib import Path
    ranks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != server_pid or \
                b"wideserve.engine.engine_proc" not in args:
            continue
        config = args[args.index(b"--config-json") + 1].decode()
        import json
        ranks[json.loads(config)["parallel"]["data_parallel_rank"]] = int(entry.name)
    return ranks


@contextlib.contextmanager
def net_namespaces(names: tuple[str, str], addresses: tuple[str, str], veth: str
                   ) -> Iterator[Callable[..., subprocess.Popen]]:
    """Two network namespaces joined by a veth pair (`{veth}0` / `{veth}1`), each with its
    address on a /24; yields run_in(node, cmd, stdout) -> Popen inside node's namespace with
    GLOO_SOCKET_IFNAME on its veth. The namespaces are deleted on the way out, always."""
    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def delete() -> None:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    delete()
    try:
        for ns in names:
            ip("netns", "add", ns)
        ip("link", "add", f"{veth}0", "type", "veth", "peer", "name", f"{veth}1")
        for i, ns in enumerate(names):
            ip("link", "set", f"{veth}{i}", "netns", ns)
            ip("-n", ns, "addr", "add", f"{addresses[i]}/24", "dev", f"{veth}{i}")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", f"{veth}{i}", "up")

        def run_in(node: int, cmd: list[str], stdout: Any) -> subprocess.Popen:
            env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=f"{veth}{node}",
                       HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
            return subprocess.Popen(["ip", "netns", "exec", names[node], *cmd], env=env,
                                    stdout=stdout, stderr=subprocess.STDOUT
                                    if stdout is not subprocess.PIPE else None, text=True)
        yield run_in
    finally:
        delete()
