"""`wideserve serve --data-parallel-size 2 --enable-expert-parallel` end to end: requests are
spread over both ranks (identical greedy text whichever rank serves a prompt), /metrics has
per-rank series; then one rank is killed mid-stream: the stream ends with an error, /health
fails with 503, and the server and the other rank exit within a bounded time, leaving no
process behind. A rank that hangs (SIGSTOP) is held to the server's heartbeat and stall
timeouts like a single engine: /health fails, its requests end with an error, nothing stays."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints" / "openai"))
from oai_server_utils import RemoteServer, pid_alive  # noqa: E402

from dist_utils import engine_children, free_port_block  # noqa: E402

PROMPT = "To be, or not to be"


def _complete(url: str, max_tokens: int = 6) -> str:
    r = httpx.post(url + "/v1/completions", json={
        "model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _metric(text: str, name: str, rank: int) -> float:
    for line in text.splitlines():
        if line.startswith(f"wideserve:{name}{{") and f'dp_rank="{rank}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for rank {rank} in /metrics")


def test_dep2_server_spreads_requests_and_fails_cleanly_when_a_rank_dies():
    srv = RemoteServer(["--served-model-name", "m", "-dp", "2", "--enable-expert-parallel",
                        "--data-parallel-rpc-port", str(free_port_block(6)),
                        "--dp-sync-timeout", "20", "--max-num-seqs", "8",
                        "--kv-cache-memory", "64MiB", "--block-size", "32"])
    try:
        ranks = engine_children(srv.proc.pid)
        assert sorted(ranks) == [0, 1]
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda _: _complete(srv.url), range(4)))
        assert len(set(texts)) == 1 and texts[0]
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        for rank in (0, 1):
            assert _metric(metrics, "dp_requests_routed_total", rank) >= 1
            assert _metric(metrics, "dp_step_syncs_total", rank) > 0

        with httpx.stream("POST", srv.url + "/v1/completions", json={
                "model": "m", "prompt": PROMPT, "max_tokens": 400, "temperature": 0.0,
                "ignore_eos": True, "stream": True}, timeout=60) as stream:
            assert stream.status_code == 200, stream.read()
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert "error" not in first
            killed_at = time.monotonic()
            srv_ranks = engine_children(srv.proc.pid)
            victim = 1 if 1 in srv_ranks else 0
            os.kill(srv_ranks[victim], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data:")]
        assert time.monotonic() - killed_at < 30
        errors = [json.loads(line[5:]) for line in rest if line != "data: [DONE]"
                  and "error" in json.loads(line[5:])]
        assert errors, f"the stream ended without an error: {rest[-3:]}"
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503
        srv.proc.wait(timeout=30)
        assert srv.proc.returncode == 1
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(pid_alive(p) for p in ranks.values()), "an engine rank outlived the server"
    finally:
        code = srv.close()
        if code not in (0, 1):
            print(srv.read_output()[-5000:])


def _stream_events(url: str, events: list[str], started: threading.Event) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json={
                    "model": "m", "prompt": PROMPT, "max_tokens": 400, "temperature": 0.0,
                    "ignore_eos": True, "stream": True}, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        events.append(line[5:].strip())
                        started.set()
        except httpx.HTTPError as e:
            events.append(f"transport error: {e}")
        finally:
            started.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_dep2_stopped_rank_is_held_to_the_heartbeat_and_stall_timeouts():
    """Before: the DP path watched ranks with a fixed 60 s (the flags reached only a single
    engine), so /health stayed 200 and the stream hung for a minute."""
    srv = RemoteServer(["--served-model-name", "m", "-dp", "2", "--enable-expert-parallel",
                        "--data-parallel-rpc-port", str(free_port_block(6)),
                        "--dp-sync-timeout", "120", "--max-num-seqs", "8",
                        "--kv-cache-memory", "64MiB", "--block-size", "32",
                        "--engine-heartbeat-timeout", "2", "--engine-stall-timeout", "5"])
    ranks = engine_children(srv.proc.pid)
    try:
        assert sorted(ranks) == [0, 1]
        events: list[str] = []
        started = threading.Event()
        t = _stream_events(srv.url, events, started)
        assert started.wait(60) and events and "error" not in events[0], events[:3]
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        with httpx.Client(timeout=5) as http:
            while True:
                health = http.get(srv.url + "/health")
                if health.status_code != 200 or time.monotonic() - stopped > 30:
                    break
                time.sleep(0.1)
        health_s = time.monotonic() - stopped
        assert health.status_code == 503, health.text
        assert health_s < 10, f"/health still 200 {health_s:.1f} s after the rank stopped"
        t.join(30)
        assert not t.is_alive(), "the stream hung with a stopped rank"
        error_s = time.monotonic() - stopped
        assert error_s < 20, f"the stream ended {error_s:.1f} s after the rank stopped"
        assert events[-1] == "[DONE]" and any("error" in e for e in events[-3:]), events[-3:]
        srv.proc.wait(timeout=30)
        assert srv.proc.returncode == 1
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(pid_alive(p) for p in ranks.values()), "a rank outlived the server"
    finally:
        for pid in ranks.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        code = srv.close(signal.SIGKILL)
        if code not in (0, 1, -signal.SIGKILL):
            print(srv.read_output()[-5000:])
