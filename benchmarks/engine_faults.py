"""How fast a server notices a dead or hung engine core (docs/reliability.md).

Starts `wideserve serve` on the bundled model (CPU), opens a stream, then either SIGKILLs the
engine core or SIGSTOPs it, and times, from the signal: /health turning 503, a new request's
503, the open stream's error event + [DONE], and the server's exit (code 1).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/engine_faults.py [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HEARTBEAT_TIMEOUT, STALL_TIMEOUT = 2.0, 6.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_pid(server_pid: int) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid and b"engine_proc" in cmd:
                return int(entry.name)
    raise LookupError("no engine core")


def _start() -> tuple[subprocess.Popen, str, object]:
    port = _port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "wideserve.entrypoints.cli", "serve", "--device", "cpu",
         "--port", str(port), "--log-level", "warning",
         "--engine-heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
         "--engine-stall-timeout", str(STALL_TIMEOUT)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not start")


def one_run(sig: int) -> dict[str, float | int | None]:
    proc, url, log = _start()
    marks: dict[str, float] = {}
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "ROMEO.", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: {") and "error" in json.loads(line[6:]):
                    marks["stream_error"] = time.monotonic()
                if line == "data: [DONE]":
                    marks["stream_done"] = time.monotonic()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    started.wait(60)
    engine = _engine_pid(proc.pid)
    t0 = time.monotonic()
    os.kill(engine, sig)
    while proc.poll() is None and time.monotonic() - t0 < 30:
        try:
            if "health_503" not in marks and \
                    httpx.get(url + "/health", timeout=1).status_code == 503:
                marks["health_503"] = time.monotonic()
            if "new_request_503" not in marks and httpx.post(
                    url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                    timeout=2).status_code == 503:
                marks["new_request_503"] = time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    code = proc.wait(30)
    marks["server_exit"] = time.monotonic()
    t.join(5)
    if sig == signal.SIGSTOP:
        try:
            os.kill(engine, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out: dict[str, float | int | None] = {k: round(v - t0, 2) for k, v in marks.items()}
    out["exit_code"] = code
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = {name: [one_run(sig) for _ in range(args.runs)]
               for name, sig in (("sigkill", signal.SIGKILL), ("sigstop", signal.SIGSTOP))}
    print(json.dumps({"heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
                      "stall_timeout_s": STALL_TIMEOUT, "results": results}, indent=1))


if __name__ == "__main__":
    main()
