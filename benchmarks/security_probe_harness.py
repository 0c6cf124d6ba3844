"""The security probe's harness (benchmarks/security_probe.py): the processes it starts,
the unrelated stream it watches, one case with its timeout, and the totals."""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

MARKER = "WIDESERVE_PROBE"
MODEL = "probe"
API_KEY = "probe-key-" + secrets.token_hex(8)
SECRET_USER = "probe-user-" + secrets.token_hex(6)
SECRET_PROMPT = "probe-prompt-" + secrets.token_hex(6)
STALL_GOAL_S = 0.25


@dataclass
class Sizes:
    tools: int
    schema_mb: int
    logit_bias: int
    prompts: int
    header_mb: int
    choices: int
    router_body_mb: int
    case_timeout_s: float


FULL = Sizes(tools=10_000, schema_mb=60, logit_bias=1_000_000, prompts=10_000_000,
             header_mb=32, choices=100_000, router_body_mb=100, case_timeout_s=90.0)
QUICK = Sizes(tools=10_000, schema_mb=16, logit_bias=200_000, prompts=2_000_000,
              header_mb=32, choices=50_000, router_body_mb=70, case_timeout_s=45.0)


@dataclass
class Row:
    case: str
    expected: str
    observed: str = ""
    passed: bool = False
    hostile: bool = True
    gap_s: float | None = None


@dataclass
class Totals:
    rows: list[Row] = field(default_factory=list)
    five_xx: int = 0
    kv_bytes_stolen: float = 0.0
    procs_left: int = -1


TOTALS = Totals()


def _count_5xx(response: httpx.Response) -> None:
    if response.status_code >= 500:
        TOTALS.five_xx += 1


def hostile_client(timeout: float) -> httpx.Client:
    """Requests of hostile cases: their 5xx answers are counted as unexpected (a case that
    expects a 5xx, such as a health check with an instance down, uses a plain client)."""
    return httpx.Client(timeout=timeout, event_hooks={"response": [_count_5xx]})


# ----------------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               UCX_NET_DEVICES="lo", UCX_MODULES="^ib")
    env[MARKER] = str(os.getpid())
    env.update(extra or {})
    return env


class Server:
    """`wideserve serve ...` (or `router ...`) on a free loopback port, logging to a file."""

    def __init__(self, kind: str, args: list[str], env: dict[str, str] | None = None,
                 ready_timeout_s: float = 300.0, key: str | None = None,
                 ready_any_status: bool = False) -> None:
        """ready_any_status: up once /health answers at all (a router with no live
        prefill instance may rightly answer 503)."""
        self.kind, self.args, self.extra_env, self.key = kind, args, env, key
        self.ready_any_status = ready_any_status
        self.ready_timeout_s = ready_timeout_s
        self.start()

    def start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"probe-{self.kind}-", suffix=".log")
        cmd = [sys.executable, "-m", "wideserve.entrypoints.cli", self.kind, *self.args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, env=_env(self.extra_env), stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited at start-up:\n{self.output()[-3000:]}")
            if self.healthy(1.0, any_status=self.ready_any_status):
                return
            time.sleep(0.3)
        raise RuntimeError(f"{self.kind} not healthy in {self.ready_timeout_s:.0f} s")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def healthy(self, timeout: float, any_status: bool = False) -> bool:
        try:
            code = httpx.get(self.url + "/health", timeout=timeout).status_code
            return any_status or code == 200
        except httpx.HTTPError:
            return False

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def recover(self, timeout_s: float = 60.0) -> str:
        """After a case: responsive again within timeout_s, else restarted."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.healthy(2.0):
                return ""
            time.sleep(0.5)
        self.stop()
        self.start()
        return f"; {self.kind} restarted (unresponsive after the case)"


def ours() -> list[int]:
    """Live processes carrying our marker (started by this probe, orphans included)."""
    marker = f"{MARKER}={os.getpid()}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if state != "Z" and marker in env.split(b"\0"):
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except OSError:
                pass


# ------------------------------------------------------------------------------ watching

class StreamWatch:
    """One unrelated greedy stream after another on `url`; the longest gap between two
    events of one stream since the last reset (the stall every other client would see)."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url, self.headers = url, headers
        self.gap = 0.0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {"model": MODEL, "prompt": "To be, or not to be", "max_tokens": 400,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                try:
                    with client.stream("POST", self.url + "/v1/completions", json=body,
                                       headers=self.headers) as r:
                        last = None
                        for line in r.iter_lines():
                            now = time.perf_counter()
                            if not line.startswith("data:"):
                                continue
                            if last is not None:
                                self.gap = max(self.gap, now - last)
                            last = now
                            if self._stop.is_set():
                                return
                except httpx.HTTPError:
                    self.errors += 1
                    time.sleep(0.5)

    def reset(self) -> float:
        gap, self.gap = self.gap, 0.0
        return gap

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def run_case(row: Row, fn: Callable[[], tuple[str, bool]], timeout_s: float,
             watch: StreamWatch | None = None, server: Server | None = None) -> Row:
    """fn() -> (observed, passed), on a thread, for at most timeout_s."""
    result: list[Any] = []

    def target() -> None:
        try:
            result.append(fn())
        except Exception as e:  # noqa: BLE001 - a case's failure is a table row
            result.append((f"probe error: {type(e).__name__}: {str(e)[:150]}", False))

    if watch is not None:
        time.sleep(0.3)
        watch.reset()
    start = time.monotonic()
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if result:
        row.observed, row.passed = result[0]
    else:
        row.observed, row.passed = f"no answer in {timeout_s:.0f} s (timed out)", False
    if watch is not None:
        time.sleep(0.3)
        row.gap_s = watch.reset()
    if server is not None:
        row.observed += server.recover()
    TOTALS.rows.append(row)
    mark = "PASS" if row.passed else "FAIL"
    print(f"  [{mark}] {row.case}: {row.observed} ({time.monotonic() - start:.1f} s)",
          flush=True)
    return row


def status_case(client: httpx.Client, method: str, url: str, *, ok: Callable[[int], bool],
                 limit_s: float, **kw: Any) -> tuple[str, bool]:
    start = time.monotonic()
    r = client.request(method, url, **kw)
    took = time.monotonic() - start
    msg = message(r)
    return (f"{r.status_code} in {took:.1f} s{': ' + msg if msg else ''}",
            ok(r.status_code) and took <= limit_s)


def message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
        text = err.get("message", "") if isinstance(err, dict) else str(err or "")
    except (ValueError, AttributeError):
        text = "" if r.status_code < 400 else r.text
    return text[:90].replace("\n", " ")


def is_4xx(code: int) -> bool:
    return 400 <= code < 500


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
