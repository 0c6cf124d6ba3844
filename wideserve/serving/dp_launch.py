"""`wideserve serve --headless ...`: a node that runs engine-core ranks but no API server.

It starts ranks data_parallel_start_rank .. + data_parallel_size_local - 1, each connecting to
the sockets the front end on node 0 bound for it (`rank_addresses`), and waits. It exits when
its ranks have exited (the group stopped or failed: a rank that loses its peers exits by
itself); SIGTERM / SIGINT stop them. Ranks whose parent disappears stop too (engine_proc).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgspec

from wideserve.config import EngineConfig
from wideserve.parallel.devices import DevicePlanError, plan_devices
from wideserve.serving.dp_client import DP_ENGINE, rank_addresses, rank_config
from wideserve.utils.procs import child_env


def spawn_rank(config: EngineConfig, rank: int, heartbeat_s: float = 1.0
               ) -> subprocess.Popen[bytes]:
    in_addr, out_addr = rank_addresses(config.parallel, rank)
    cmd = [sys.executable, "-m", "wideserve.engine.engine_proc",
           "--config-json", msgspec.json.encode(rank_config(config, rank)).decode(),
           "--input-addr", in_addr, "--output-addr", out_addr,
           "--parent-pid", str(os.getpid()), "--engine", DP_ENGINE,
           "--heartbeat-s", str(heartbeat_s)]
    return subprocess.Popen(cmd, env=child_env(), stdin=subprocess.DEVNULL)


def run_headless(config: EngineConfig) -> int:
    p = config.parallel
    ranks = list(range(p.data_parallel_start_rank, p.data_parallel_start_rank + p.local_size))
    try:                                  # refuse too few devices before spawning a rank
        devices = plan_devices(p, config.load.device)
    except DevicePlanError as e:
        print(f"wideserve serve: error: {e}", file=sys.stderr)
        return 2
    print(f"wideserve | headless: ranks {ranks[0]}..{ranks[-1]} of {p.data_parallel_size} on "
          f"{', '.join(devices.devices)}, front end at {p.data_parallel_address}:"
          f"{p.data_parallel_rpc_port}", flush=True)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    procs = [spawn_rank(config, r) for r in ranks]
    try:
        while not stopping and any(proc.poll() is None for proc in procs):
            time.sleep(0.2)
    finally:
        _stop_all(procs, grace_s=0.0 if stopping else p.dp_sync_timeout_s + 10.0)
    codes = [proc.returncode for proc in procs]
    return 0 if stopping or all(c == 0 for c in codes) else 1


def _stop_all(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Ranks still running get SIGTERM at once when we were told to stop, or after grace_s
    (their group's timeout) when a sibling ended; SIGKILL 5 s later. No orphans."""
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
