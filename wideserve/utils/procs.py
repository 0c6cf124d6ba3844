"""Child processes die with their parent (docs/reliability.md, "Process lifetime").

Every process wideserve starts (engine cores, data-parallel ranks, the API server's
tokenizer worker) calls `die_with_parent()` first thing. A SIGKILLed server then leaves no
process behind: not its engines (which would otherwise hold memory and ports until their loop
noticed), not its tokenizer worker (which would otherwise block forever on a queue whose
write end it holds itself) and, with the worker gone, not multiprocessing's resource tracker
(it exits when the last holder of its pipe does).

Two mechanisms, because each misses a case:
- `prctl(PR_SET_PDEATHSIG, SIGKILL)` (Linux): the kernel kills the child the moment its parent
  goes, even a child that is stopped (SIGSTOP) or stuck in native code. It fires when the
  parent *thread* that created the child exits, so it is armed only for children started
  from the parent's main thread (which lives as long as the process does); the parent says
  which in the child's environment (`child_env`) or in its arguments.
- a daemon thread that polls `os.getppid()` against the expected parent: covers children
  started from other threads, and non-Linux systems. It needs the child's interpreter to run.

Either way the parent may already be gone before the child arms them (it died while the child
was importing), so the parent pid is checked once right after arming.

This module imports only the standard library: it sits below every other layer.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

# Set by the parent in a child's environment (child_env): whether the death signal may be
# armed (the child was started from the parent's main thread).
PDEATHSIG_ENV = "WIDESERVE_PDEATHSIG"
PR_SET_PDEATHSIG = 1
POLL_S = 0.5


def spawned_from_main_thread() -> bool:
    """True when a child started now is safe to bind to this thread's lifetime."""
    return threading.current_thread() is threading.main_thread()


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: ours) plus what `die_with_parent` needs in a child started now."""
    out = dict(os.environ if env is None else env)
    out[PDEATHSIG_ENV] = "1" if spawned_from_main_thread() else "0"
    return out


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` when our parent (thread) exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int, *, pdeathsig: bool | None = None,
                    poll_s: float = POLL_S) -> None:
    """Make this process end when `parent_pid` (our parent) does; call it at start-up.

    pdeathsig: arm the death signal; False when the parent started us from a thread other
    than its main one (see the module docstring), None: as `child_env` said."""
    if pdeathsig is None:
        pdeathsig = os.environ.get(PDEATHSIG_ENV) == "1"
    if pdeathsig:
        set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent_pid:          # gone before the signal was armed
        _end_self()
    watcher = threading.Thread(target=_watch_parent, args=(parent_pid, poll_s),
                               name="wideserve-parent-watch", daemon=True)
    watcher.start()


def _watch_parent(parent_pid: int, poll_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    _end_self()


def _end_self() -> None:
    # SIGKILL, not sys.exit: nothing of ours is worth flushing once nobody reads our output,
    # and an exit from a non-main thread would only end that thread.
    os.kill(os.getpid(), signal.SIGKILL)


def descendants(root: int) -> list[int]:
    """Every live descendant of `root` (children first), read from /proc (Linux): what a
    check that nothing outlived its parent walks."""
    from pathlib import Path

    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append(pid)
            todo.append(pid)
    return out
