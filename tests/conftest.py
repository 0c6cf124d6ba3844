import os

# One torch thread per process: on this 2-core machine two threads beside any other busy
# process are ~10x slower (measured on the 2-core CI machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


# --- The suite leaves no process behind (issue 25) ------------------------------------------
# Every process a test starts inherits this marker in its environment (and pytest's
# PYTEST_CURRENT_TEST, naming the test that started it); orphans keep both after they are
# reparented, so they are found by marker as well as by ancestry. At the end of the session
# whatever is still running is reported, killed, and fails the run.
import signal as _signal  # noqa: E402
import time as _time  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

import pytest as _pytest  # noqa: E402

_LEAK_MARKER = "WIDESERVE_TEST_SESSION"
_LEAK_GRACE_S = 10.0              # processes still shutting down when the last test ended
# The top pytest process's pid: an xdist worker keeps its controller's (which checks).
os.environ.setdefault(_LEAK_MARKER, str(os.getpid()))


def _proc_table() -> dict[int, tuple[int, str, bytes, bytes]]:
    """pid -> (ppid, state, cmdline, environ) of every readable process."""
    table = {}
    for entry in _Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        table[int(entry.name)] = (int(stat[1]), stat[0], cmdline, environ)
    return table


def _leftovers() -> dict[int, tuple[int, str, bytes, bytes]]:
    me = os.getpid()
    table = _proc_table()
    marker = f"{_LEAK_MARKER}={me}".encode()
    ours = {pid for pid, (_, _, _, env) in table.items() if marker in env.split(b"\0")}
    todo = [me]
    while todo:                                   # descendants (started without the marker)
        parent = todo.pop()
        for pid, (ppid, *_) in table.items():
            if ppid == parent and pid not in ours:
                ours.add(pid)
                todo.append(pid)
    # Not leaks: ourselves, zombies, and helpers of this very process that end with it:
    # multiprocessing's resource tracker, torch inductor's compile workers (more cores).
    from multiprocessing import resource_tracker
    keep = {me, getattr(resource_tracker._resource_tracker, "_pid", None)}
    return {pid: table[pid] for pid in ours if pid not in keep and table[pid][1] != "Z"
            and b"torch._inductor.compile_worker" not in table[pid][2]}


def _describe(pid: int, info: tuple[int, str, bytes, bytes]) -> str:
    ppid, _, cmdline, environ = info
    test = next((v.split(b"=", 1)[1].decode(errors="replace")
                 for v in environ.split(b"\0") if v.startswith(b"PYTEST_CURRENT_TEST=")),
                "(started outside a test)")
    cmd = cmdline.replace(b"\0", b" ").decode(errors="replace")[:160]
    return f"pid {pid} (ppid {ppid}) from {test}: {cmd}"


@_pytest.hookimpl(trylast=True)           # after the session fixtures' teardown
def pytest_sessionfinish(session: _pytest.Session, exitstatus: int) -> None:
    if os.environ[_LEAK_MARKER] != str(os.getpid()):
        return          # an xdist worker (or a pytest run by a test): the top process checks
    deadline = _time.monotonic() + _LEAK_GRACE_S
    leaks = _leftovers()
    while leaks and _time.monotonic() < deadline:
        _time.sleep(0.2)
        leaks = _leftovers()
    if not leaks:
        return
    lines = [_describe(pid, info) for pid, info in sorted(leaks.items())]
    for pid in leaks:
        try:
            os.kill(pid, _signal.SIGKILL)
        except OSError:
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    header = f"{len(lines)} process(es) left behind by the tests (killed now)"
    if reporter is not None:
        reporter.line("")
        reporter.write_sep("=", header, red=True, bold=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print(header, *lines, sep="\n")
    session.exitstatus = _pytest.ExitCode.TESTS_FAILED
