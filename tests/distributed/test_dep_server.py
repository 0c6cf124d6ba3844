"""`wideserve serve --data-parallel-size 2 --enable-expert-parallel` end to end: requests are
spread over both ranks (identical greedy text whichever rank serves a prompt), /metrics has
per-rank series; then one rank is killed mid-stream: the stream ends with an error, /health
fails with 503, and the server and the other rank exit within a bounded time, leaving no
process behind."""
from __future__ import annotations

import json
import os
import signal
import sys
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
