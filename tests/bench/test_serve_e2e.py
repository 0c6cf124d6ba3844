"""`wideserve bench serve` end to end against a real `wideserve serve` subprocess (bundled
model, one thread): every JSON field, plots, the agentic replay, and Ctrl-C partial results."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from ports import free_port

from wideserve.bench.prometheus import parse_metrics
from wideserve.entrypoints.cli import main as cli_main

POINT_FIELDS = {
    "max_concurrency", "request_rate", "interrupted", "num_requests", "completed", "failed",
    "error_rate", "context_overflows", "context_overflow_rate", "errors", "duration_s",
    "wall_s", "total_input_tokens", "total_output_tokens", "request_throughput",
    "input_throughput", "output_throughput", "total_token_throughput", "ttft_s", "tpot_s",
    "itl_s", "e2el_s", "isl", "osl", "e2e_interactivity_tok_s_user",
    "tpot_interactivity_tok_s_user", "client_cached_prompt_fraction", "num_gpus", "per_gpu",
    "server"}
DIST_FIELDS = {"mean", "std", "min", "max", "p50", "p75", "p90", "p95", "p99"}


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def server():
    port = free_port()          # outside the ephemeral range (tests/ports.py)
    proc = subprocess.Popen(
        [sys.executable, "-m", "wideserve.entrypoints.cli", "serve", "--port", str(port),
         "--dtype", "float32", "--log-level", "warning"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail("server did not start in 120 s")
    yield url
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_random_sweep_json_and_plots(server, tmp_path):
    out = tmp_path / "r.json"
    rc = cli_main(["bench", "serve", "--base-url", server, "--num-prompts", "6",
                   "--input-len", "64", "--output-len", "8", "--max-concurrency", "1", "3",
                   "--num-warmups", "1", "--num-gpus", "2", "--output-json", str(out),
                   "--plot-dir", str(tmp_path / "plots"), "--save-samples", "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert {"command", "machine", "base_url", "model", "endpoint", "dataset", "num_gpus",
            "points", "interrupted", "samples"} <= res.keys()
    assert res["model"] == "shakespeare-v4-tiny" and not res["interrupted"]
    assert [p["max_concurrency"] for p in res["points"]] == [1, 3]
    for p in res["points"]:
        assert POINT_FIELDS <= p.keys()
        for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s", "isl", "osl"):
            assert DIST_FIELDS <= p[key].keys()
        assert (p["completed"], p["failed"], p["context_overflows"]) == (6, 0, 0)
        assert p["isl"]["min"] == p["isl"]["max"] == 64           # server-counted tokens
        assert p["osl"]["min"] == p["osl"]["max"] == 8            # ignore_eos honoured
        assert p["total_token_throughput"] == pytest.approx(
            (p["total_input_tokens"] + p["total_output_tokens"]) / p["duration_s"])
        assert p["per_gpu"]["total_token_throughput"] == pytest.approx(
            p["total_token_throughput"] / 2)
        assert 0 < p["ttft_s"]["p50"] <= p["e2el_s"]["p50"]
        assert p["server"]["prefix_cache_hit_rate"] is not None    # read from /metrics
        assert p["server"]["spec_decode"] is None                  # not exported: absent
    # One ITL per gap between content chunks. A client that falls a step behind gets the
    # deltas of several steps in one chunk (async_engine merges them), so under load a
    # request can stream fewer than 8 chunks: at most 7 gaps each, at least one.
    itls = res["samples"][0]["itl_s"]
    assert 6 <= len(itls) <= 6 * 7
    assert sum(itls) / len(itls) == pytest.approx(res["points"][0]["itl_s"]["mean"], abs=1e-5)
    for name in ("random_sweep.png", "random_latency.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000


def test_agentic_replay(server, tmp_path):
    out = tmp_path / "a.json"
    rc = cli_main(["bench", "serve", "--base-url", server, "--dataset", "agentic",
                   "--agentic-scale", "0.003", "--agentic-sessions", "4",
                   "--agentic-min-osl", "2", "--duration", "3", "--warmup-per-lane", "1",
                   "--time-scale", "0.01", "--max-concurrency", "2", "--output-json",
                   str(out), "--no-progress"])
    assert rc == 0
    p = json.loads(out.read_text())["points"][0]
    assert POINT_FIELDS | {"sessions_started", "sessions_completed"} <= p.keys()
    assert p["completed"] > 0 and p["failed"] == 0
    assert p["osl"]["min"] >= 2 and p["sessions_started"] >= 2
    assert 0.0 <= p["server"]["prefix_cache_hit_rate"] <= 1.0


def _generated(url: str) -> float:
    return parse_metrics(httpx.get(url + "/metrics").text).get("generation_tokens", 0.0)


def test_ctrl_c_writes_partial_results(server, tmp_path):
    out = tmp_path / "i.json"
    before = _generated(server)
    proc = subprocess.Popen(
        [sys.executable, "-m", "wideserve.entrypoints.cli", "bench", "serve", "--base-url",
         server, "--num-prompts", "500", "--input-len", "32", "--output-len", "16",
         "--max-concurrency", "1", "--num-warmups", "0", "--output-json", str(out),
         "--no-progress"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    deadline = time.time() + 60          # interrupt once the run is well under way
    while time.time() < deadline and _generated(server) < before + 40:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    log, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, log
    res = json.loads(out.read_text())
    p = res["points"][0]
    assert res["interrupted"] and p["interrupted"]
    assert 0 < p["completed"] < 500 and p["failed"] == 0
