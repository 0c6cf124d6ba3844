"""A real server whose engine core dies (SIGKILL) or hangs (SIGSTOP): open streams end with an
error event and [DONE], /health and new requests get 503 while the heartbeat is stale, and the
API process exits with code 1 so a supervisor restarts it (docs/reliability.md)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from oai_server_utils import RemoteServer, pid_alive, write_tiny_model

COMMON = ["--load-format", "dummy", "--device", "cpu", "--block-size", "16",
          "--kv-cache-memory", "4MiB"]
# Long enough to be still running when the test (woken by its first chunk) signals the
# engine on a loaded machine: 4,000 tokens of the tiny model take seconds, 200 took 0.15-1 s.
LONG = 4096
STREAM = {"prompt": "Hello", "max_tokens": LONG - 96, "stream": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), max_len=LONG)


def _open_stream(url: str, events: list[str], started: threading.Event) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=STREAM, timeout=60) as r:
                for line in r.iter_lines():
                    events.append(line)
                    started.set()
        except httpx.HTTPError as e:
            events.append(f"transport error: {e}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _ends_with_error_and_done(events: list[str], needle: str) -> None:
    data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert "error" in data[-1] and needle in data[-1]["error"]["message"], events[-3:]
    assert [e for e in events if e][-1] == "data: [DONE]"


def _wait_exit(srv: RemoteServer, timeout: float) -> int | None:
    try:
        return srv.proc.wait(timeout)
    except Exception:  # noqa: BLE001 - still running: the caller asserts
        return None


def test_engine_death_ends_streams_and_the_server_exits_1(model_dir):
    srv = RemoteServer([str(model_dir), *COMMON])
    try:
        engine_pid = srv.engine_pid()
        events: list[str] = []
        started = threading.Event()
        t = _open_stream(srv.url, events, started)
        assert started.wait(30)
        killed = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        t.join(15)
        assert not t.is_alive(), "stream hung after the engine died"
        _ends_with_error_and_done(events, "engine")
        code = _wait_exit(srv, 20)
        assert code == 1, srv.read_output()[-3000:]
        assert time.monotonic() - killed < 15
        assert "exit code 1, so a supervisor can restart it" in srv.read_output()
    finally:
        srv.close(signal.SIGKILL)


def test_hung_engine_fails_health_then_streams_then_exits(model_dir):
    srv = RemoteServer([str(model_dir), *COMMON, "--engine-heartbeat-timeout", "1.5",
                        "--engine-stall-timeout", "4"])
    engine_pid = srv.engine_pid()
    try:
        events: list[str] = []
        started = threading.Event()
        t = _open_stream(srv.url, events, started)
        assert started.wait(30)
        os.kill(engine_pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with httpx.Client(timeout=5) as http:
            while True:                       # /health fails within the heartbeat timeout
                health = http.get(srv.url + "/health")
                if health.status_code == 503 or time.monotonic() - stopped > 5:
                    break
                time.sleep(0.1)
            assert health.status_code == 503 and "silent" in health.json()["error"]["message"]
            assert time.monotonic() - stopped < 4
            t0 = time.monotonic()
            r = http.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            assert time.monotonic() - t0 < 2                          # refused, not queued
        t.join(15)
        assert not t.is_alive(), "stream hung with a stopped engine"
        _ends_with_error_and_done(events, "no heartbeat")
        assert 3.5 < time.monotonic() - stopped < 12
        assert _wait_exit(srv, 20) == 1, srv.read_output()[-3000:]
        deadline = time.monotonic() + 5
        while pid_alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(engine_pid), "the hung engine was left behind"
    finally:
        if pid_alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
        srv.close(signal.SIGKILL)
