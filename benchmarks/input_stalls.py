"""Does one hostile request's input processing stall everyone else? (issues 15 and 25)

Starts `wideserve serve` (the bundled model unless --model), keeps one greedy stream and a
/health poller running, sends each hostile body, and reports its status and time, the worst
/health latency and the worst gap between the stream's tokens (ITL max) while it was
processed, and the API process's RSS before and after; last, the ITL max over all cases.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/input_stalls.py [--cases 50mb,chat,ids]
    ... --cases tools,schema,logit_bias,history,prompts10m    # issue 25's
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

CASES = {
    # No hostile request: the token gap the machine's load alone gives (the noise floor).
    "baseline": ("/v1/completions", lambda: {"prompt": "a", "max_tokens": 1}),
    "50mb": ("/v1/completions", lambda: {"prompt": "word " * 10_500_000, "max_tokens": 1}),
    "10mb": ("/v1/completions", lambda: {"prompt": "word " * 2_100_000, "max_tokens": 1}),
    "chat": ("/v1/chat/completions",
             lambda: {"messages": [{"role": "user", "content": "word"}] * 700_000}),
    "ids": ("/v1/completions", lambda: {"prompt": [7] * 7_000_000, "max_tokens": 1}),
    "fanout": ("/v1/completions", lambda: {"prompt": ["hi"] * 200, "n": 128, "max_tokens": 1}),
    # issue 25: 14 s, 52.8 s and seconds of stall of every other stream before.
    "tools": ("/v1/chat/completions", lambda: {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
            "type": "object", "properties": {"a": {"type": "string"}}}}}
            for i in range(10_000)]}),
    # Within the default limits: validated and templated in the prep threads.
    "tools500": ("/v1/chat/completions", lambda: {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
            "type": "object", "properties": {f"a{j}": {"type": "string", "enum": ["x", "y"]}
                                             for j in range(8)}}}} for i in range(500)]}),
    "schema": ("/v1/chat/completions", lambda: {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "anyOf": [{"const": f"value-{i}"} for i in range(400_000)]}}}}),
    "logit_bias": ("/v1/completions", lambda: {
        "prompt": "a", "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(200_000)}}),
    "history": ("/v1/chat/completions", lambda: {"messages": [
        {"role": "assistant", "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
            "name": "f", "arguments": "{}"}}]} for i in range(50_000)]}),
    "prompts10m": ("/v1/completions", lambda: {"prompt": [[1]] * 10_000_000, "max_tokens": 1}),
}


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Probe:
    """/health every 20 ms and one long greedy stream; the worst latency and token gap."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.health_worst = self.gap_worst = 0.0
        self.threads = [threading.Thread(target=self._health, daemon=True),
                        threading.Thread(target=self._stream, daemon=True)]
        for t in self.threads:
            t.start()
        time.sleep(1.0)                       # the stream is under way
        self.health_worst = self.gap_worst = 0.0

    def _health(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                c.get(self.url + "/health")
                self.health_worst = max(self.health_worst, time.perf_counter() - t)
                time.sleep(0.02)

    def _stream(self) -> None:
        body = {"prompt": "To be", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                with c.stream("POST", self.url + "/v1/completions", json=body) as r:
                    last = time.perf_counter()
                    for _ in r.iter_lines():
                        now = time.perf_counter()
                        self.gap_worst = max(self.gap_worst, now - last)
                        last = now
                        if self.stop.is_set():
                            break

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="10mb,50mb,chat,ids,fanout")
    ap.add_argument("--model", default=None)
    ap.add_argument("--server-args", default="",
                    help="more `wideserve serve` flags, e.g. '--kv-cache-memory 256MiB'")
    args = ap.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "wideserve.entrypoints.cli", "serve", "--port", str(port),
           "--device", "cpu", "--log-level", "warning"] + ([args.model] if args.model else []) \
        + shlex.split(args.server_args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900         # a loaded machine starts slowly
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        itl_max = 0.0
        for name in args.cases.split(","):
            path, make = CASES[name]
            body = json.dumps(make()).encode()
            probe = _Probe(url)
            rss0 = _rss_mb(proc.pid)
            t = time.perf_counter()
            r = httpx.post(url + path, content=body, timeout=600,
                           headers={"Content-Type": "application/json"})
            took = time.perf_counter() - t
            time.sleep(0.5)
            probe.close()
            code = r.json().get("error", {}).get("code") if r.status_code != 200 else ""
            itl_max = max(itl_max, probe.gap_worst)
            print(f"{name:10s} {len(body) / 2**20:6.1f} MB -> {r.status_code} {code} in "
                  f"{took:5.2f} s; worst /health {probe.health_worst * 1000:6.0f} ms, worst "
                  f"token gap {probe.gap_worst * 1000:6.0f} ms; API RSS {rss0:.0f} -> "
                  f"{_rss_mb(proc.pid):.0f} MB", flush=True)
        print(f"ITL max of the running stream over all cases: {itl_max * 1000:.0f} ms",
              flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
