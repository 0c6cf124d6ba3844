"""The server under hostile clients (issue 15): inputs that cannot fit are rejected without
stalling anyone, fan-out is capped, half-open and trickling connections are cut, and SIGTERM
ends open streams with an error event and [DONE]. One server for the module; the SIGTERM test
runs last and stops it."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from oai_server_utils import RemoteServer, served, write_tiny_model

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 3.0       # a 10 MB upload must fit in it on a loaded machine
MAX_CONNECTIONS = 24
MAX_SEQUENCES = 8
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    # A long context: the SIGTERM test's streams must still run when the signal comes.
    model = write_tiny_model(tmp_path_factory.mktemp("tiny"), max_len=4096)
    srv = RemoteServer([str(model), "--load-format", "dummy", "--device", "cpu",
                        "--block-size", "16", "--kv-cache-memory", "4MiB",
                        "--header-read-timeout", str(HEADER_TIMEOUT),
                        "--body-read-timeout", str(BODY_TIMEOUT),
                        "--max-connections", str(MAX_CONNECTIONS),
                        "--max-sequences-per-request", str(MAX_SEQUENCES)])
    yield from served(request, srv)


def _rss_mb(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


class _HealthProbe:
    def __init__(self, url: str) -> None:
        self.url, self.stop, self.worst = url, threading.Event(), 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                t = time.perf_counter()
                assert client.get(self.url + "/health").status_code == 200
                self.worst = max(self.worst, time.perf_counter() - t)
                time.sleep(0.02)

    def close(self) -> float:
        self.stop.set()
        self.thread.join(60)
        return self.worst


HOSTILE = {   # the reproductions; before the fix: 4.4 s, 7.7 s, 2.5 s of stall (the
    # issue's 50 MB prompt takes the same path as this 10 MB one: benchmarks/input_stalls.py)
    "10MB-prompt": ("/v1/completions", lambda: {"prompt": "word " * 2_100_000}),
    "700k-messages": ("/v1/chat/completions",
                      lambda: {"messages": [{"role": "user", "content": "w"}] * 700_000}),
    "7M-ids": ("/v1/completions", lambda: {"prompt": [7] * 7_000_000}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_input_that_cannot_fit_is_rejected_without_stalling(server, case):
    path, make = HOSTILE[case]
    body = json.dumps(make()).encode()
    rss_before = _rss_mb(server.proc.pid)
    probe = _HealthProbe(server.url)
    t = time.perf_counter()
    resp = httpx.post(server.url + path, content=body, headers=JSON, timeout=120)
    took = time.perf_counter() - t
    worst = probe.close()
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert took < 20, took
    assert worst < 2.5, f"/health waited {worst:.2f} s while {case} was processed"
    assert _rss_mb(server.proc.pid) - rss_before < 600


def test_sequences_per_request_are_capped(server):
    base = {"max_tokens": 1, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions",
                   json={**base, "prompt": ["a", "b", "c"], "n": 3}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "too_many_sequences" and "--max-sequences-per-request" in \
        err["message"] and err["param"] == "n"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={**base, "messages": [{"role": "user", "content": "hi"}], "n": 9})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={**base, "prompt": ["a", "b"], "n": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


def _read_response(sock: socket.socket) -> bytes:
    """One whole HTTP response (head + Content-Length body), however it is split."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def test_half_open_connections_are_cut_and_limited(server):
    socks = [_connect(server.port) for _ in range(MAX_CONNECTIONS + 6)]
    try:
        for i, sock in enumerate(socks):       # nothing at all, or half a request head
            if i % 2:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.3)
        # Over the connection limit: a real request is refused, not queued forever.
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        t = time.perf_counter()
        assert all(_closed_by_server(s) for s in socks)
        assert time.perf_counter() - t < HEADER_TIMEOUT + 5
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        for sock in socks:
            sock.close()


def test_keep_alive_connection_with_half_a_second_request_is_cut(server):
    sock = _connect(server.port)
    try:
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in _read_response(sock)
        sock.sendall(b"GET /version HTTP/1.1\r\nHo")       # then nothing
        assert _closed_by_server(sock)
    finally:
        sock.close()


def test_trickled_body_gets_408(server):
    sock = _connect(server.port)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
        t = time.perf_counter()
        reply = _read_response(sock)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"--body-read-timeout" in reply
        assert BODY_TIMEOUT - 0.2 < time.perf_counter() - t < BODY_TIMEOUT + 5
    finally:
        sock.close()


def test_sigterm_ends_open_streams_with_an_error_and_done(server):
    """Last in the module: it stops the server."""
    results: dict[int, list[str]] = {}
    started = [threading.Event() for _ in range(4)]

    def stream(i: int) -> None:
        # 1,500 tokens each (4 x 1,500 fit the 4 MiB cache): still running when the signal
        # comes, however late a loaded machine wakes this thread (200 took 0.15-1 s).
        body = {"prompt": f"stream {i}", "max_tokens": 1500, "ignore_eos": True,
                "stream": True}
        lines = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started[i].set()
        results[i] = lines

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in started)
    t0 = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert time.perf_counter() - t0 < 5                      # inside the grace period
    assert server.proc.wait(30) == 0
    for i in range(4):
        lines = results[i]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2][len("data: "):])["error"]
        assert err["code"] == "server_shutting_down"
    log = server.read_output()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
