"""Children die with their parent (wideserve/utils/procs.py): a child armed by `die_with_parent` ends
when its parent is SIGKILLed, with the death signal (started from the parent's main thread),
with the poller alone (started from another thread), and when the parent was already gone
before it armed either. End to end: a SIGKILLed server leaves no engine, tokenizer worker or
resource tracker behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "entrypoints" / "openai"))
from oai_server_utils import RemoteServer, pid_alive, write_tiny_model  # noqa: E402

from wideserve.utils.procs import descendants  # noqa: E402

# The middle process: starts a child that arms die_with_parent, prints the child's pid, and
# waits to be killed. `mode` picks how the child is started.
_PARENT = r"""
import os, subprocess, sys, threading, time
from wideserve.utils.procs import child_env
mode = sys.argv[1]
child_code = ("import os, sys, time; from wideserve.utils.procs import die_with_parent; "
              "time.sleep(float(sys.argv[2])); die_with_parent(int(sys.argv[1])); "
              "print('armed', flush=True); time.sleep(120)")
delay = "1.5" if mode == "late" else "0"
def start():
    return subprocess.Popen([sys.executable, "-c", child_code, str(os.getpid()), delay],
                            env=child_env())
if mode == "thread":
    box = []
    t = threading.Thread(target=lambda: box.append(start()))
    t.start(); t.join()
    child = box[0]
else:
    child = start()
print(child.pid, flush=True)
time.sleep(120)
"""


def _read_line(stream, timeout_s: float) -> str:
    """The next line of a pipe, or "" if none came within timeout_s (read on a thread: the
    line may already sit in the stream's buffer, where select() cannot see it)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0].strip() if box else ""


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("mode", ["main", "thread", "late"])
def test_child_dies_when_its_parent_is_sigkilled(mode):
    """main: the death signal; thread: the poller only (a thread's exit must not kill the
    child: it is alive after the starting thread ended); late: the parent died before the
    child armed."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, mode], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    child = None
    try:
        child = int(parent.stdout.readline())
        if mode != "late":
            # The child prints 'armed' (on the pipe it shares with its parent) once
            # die_with_parent returned; the starting thread is gone by then (joined before
            # the pid was printed). Waiting for the line, not a fixed sleep: on a loaded
            # machine the child's start-up can outlast any sleep, and a child stopped before
            # it armed would outlive its parent for a reason this test does not test.
            assert _read_line(parent.stdout, 60.0) == "armed", "the child never armed"
            assert pid_alive(child), "the child died while its parent lived"
        if mode == "main":
            os.kill(child, signal.SIGSTOP)      # the death signal ends even a stopped child
        parent.kill()
        parent.wait()
        assert not _wait_gone([child], 5.0), "the child outlived its SIGKILLed parent"
    finally:
        _kill_all([child] if child else [])
        if parent.poll() is None:
            parent.kill()
        parent.wait()


def test_sigkilled_server_leaves_no_process_behind(tmp_path):
    """Before: the tokenizer's spawn worker and multiprocessing's resource tracker stayed
    (two per killed server), reparented to init, forever."""
    model = write_tiny_model(tmp_path / "tiny")
    srv = RemoteServer([str(model), "--load-format", "dummy", "--device", "cpu",
                        "--block-size", "16", "--kv-cache-memory", "4MiB"])
    tree = descendants(srv.proc.pid)
    try:
        cmdlines = [Path(f"/proc/{p}/cmdline").read_bytes() for p in tree]
        assert any(b"wideserve.engine.engine_proc" in c for c in cmdlines)
        assert any(b"spawn_main" in c for c in cmdlines), "no tokenizer worker was started"
        srv.proc.kill()
        srv.proc.wait()
        left = _wait_gone(tree, 5.0)
        assert not left, "left behind: " + "; ".join(
            Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            for p in left)
    finally:
        _kill_all(tree)
        srv.close(signal.SIGKILL)
