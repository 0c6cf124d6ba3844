"""The server's processes: startup summary, bad flags, clean SIGTERM shutdown with nothing
left behind (an engine core that dies or hangs: test_server_engine_faults.py)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from oai_server_utils import (RemoteServer, free_port, pid_alive, server_env,
                              write_tiny_model)
from wideserve.entrypoints import serve

COMMON = ["--load-format", "dummy", "--device", "cpu", "--block-size", "16",
          "--kv-cache-memory", "4MiB"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("flags, flag_name", [
    (["--max-num-seqs", "-3"], "--max-num-seqs"),
    (["--port", "70000"], "--port"),
    (["--dtype", "float8"], "--dtype"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--max-model-len", "long"], "--max-model-len"),
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--block-size", "0"], "--block-size"),
    (["--engine-heartbeat-timeout", "0.5"], "--engine-heartbeat-timeout"),
    (["--engine-stall-timeout", "-1"], "--engine-stall-timeout"),
])
def test_bad_flag_value_is_a_one_line_error(flags, flag_name, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.main(["serve", *flags])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and flag_name in lines[0] and "error" in lines[0], lines


def test_good_flags_build_the_engine_config(tmp_path):
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", str(tmp_path), "--max-model-len", "32k", "--dtype",
                              "bf16", "--no-enable-prefix-caching", "--kv-cache-memory",
                              "2GiB", "--max-num-seqs", "8", "--max-num-batched-tokens",
                              "512", "--seed", "3", "--load-format", "dummy",
                              "--kv-cache-dtype", "bfloat16", "--device", "cpu",
                              "--block-size", "64", "--scheduling-policy", "priority"])
    cfg = serve.engine_config_from_args(args)
    assert cfg.load.model == str(tmp_path) and cfg.load.dtype == "bf16"
    assert cfg.load.load_format == "dummy" and cfg.load.seed == 3 and cfg.load.device == "cpu"
    assert cfg.scheduler.max_model_len == 32000 and cfg.scheduler.max_num_seqs == 8
    assert cfg.scheduler.max_num_batched_tokens == 512 and cfg.scheduler.policy == "priority"
    assert cfg.cache.enable_prefix_caching is False and cfg.cache.kv_cache_memory == 2 << 30
    assert cfg.cache.kv_cache_dtype == "bf16" and cfg.cache.block_size == 64


def test_bad_flag_through_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "wideserve.entrypoints.cli", "serve",
                           "--max-num-seqs", "many"],
                          capture_output=True, text=True, env=server_env(), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "wideserve serve: error: argument --max-num-seqs: expected a positive integer, "
        "got 'many'"]


def test_missing_model_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "wideserve.entrypoints.cli", "serve",
                           str(tmp_path / "nope"), "--device", "cpu",
                           "--port", str(free_port())],
                          capture_output=True, text=True, env=server_env(), timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0], proc.stderr


def test_startup_summary_then_ctrl_c_mid_stream(model_dir):
    srv = RemoteServer([str(model_dir), *COMMON, "--max-model-len", "200"], new_session=True)
    engine_pid = srv.engine_pid()
    # Ctrl-C (SIGINT to the whole process group) with a stream in flight: everything exits
    # cleanly. SIGTERM is covered by the engine-death test's shutdown.
    body = {"prompt": "Hello", "max_tokens": 180, "stream": True, "ignore_eos": True}
    started = threading.Event()

    def stream() -> None:
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert started.wait(30)
    t0 = time.monotonic()
    assert srv.close(signal.SIGINT, timeout=30, group=True) == 0
    assert time.monotonic() - t0 < 20
    t.join(10)
    deadline = time.monotonic() + 5
    while pid_alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(engine_pid), "engine core outlived the server"
    out = srv.read_output()
    for needle in ("parameters:", "KV cache", "tokens", f"http://127.0.0.1:{srv.port}",
                   "context:    200 tokens"):
        assert needle in out, out


def test_server_killed_takes_the_engine_with_it(model_dir):
    srv = RemoteServer([str(model_dir), *COMMON])
    engine_pid = srv.engine_pid()
    srv.close(signal.SIGKILL)                 # no chance to clean up
    deadline = time.monotonic() + 10
    while pid_alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(engine_pid), "orphaned engine core kept running"
