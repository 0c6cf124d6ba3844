"""README.md's blocks that start servers (```bash server: MTP speculation, DEP on one node and
on two, EPLB, P/D with its router), each with the client blocks after it: every server started
as the README says in a network namespace of its own, waited for, its clients run and their
output compared, then stopped with SIGTERM with no process left (tests/readme_doc.py). Each
session is a unit of its own for xdist (tests/conftest.py, SPLIT_MODULES)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from readme_doc import Block, Session, background_script, children, commands, namespace, \
    run_session, server_ports, sessions, stop

SERVERS = [s for s in sessions() if s.server is not None]


def test_the_readme_starts_these_servers() -> None:
    texts = [s.server.text for s in SERVERS]
    for needle in ('"method": "mtp"', "--headless", "--enable-eplb", "kv_producer"):
        assert any(needle in t for t in texts), needle
    assert all(s.clients for s in SERVERS)


@pytest.mark.parametrize("session", SERVERS, ids=[f"line{s.server.line}" for s in SERVERS])
def test_server_session(session: Session, tmp_path) -> None:
    failures = run_session(session, tmp_path)
    assert not failures, "\n\n".join(failures)


def test_server_blocks_run_each_command_in_the_background() -> None:
    block = Block("bash server", "export A=1\n# node 0\nwideserve serve -dp 2 \\\n  --port 8100\n"
                  "wideserve serve --headless &\nwideserve router --port 8000\n", 1)
    assert commands(block.text) == ["export A=1", "wideserve serve -dp 2 --port 8100",
                                    "wideserve serve --headless &", "wideserve router --port 8000"]
    assert background_script(block).splitlines() == [
        "export A=1", "wideserve serve -dp 2 --port 8100 &", "wideserve serve --headless &",
        "wideserve router --port 8000 &", "wait"]
    assert server_ports(block) == [8100, 8000]
    assert server_ports(Block("bash server", "wideserve serve\n", 1)) == [8000]


def test_a_process_that_outlives_sigterm_is_reported_and_killed() -> None:
    name = f"wsreadmetest{os.getpid()}"
    with namespace(name) as prefix:
        script = "(trap '' TERM; exec sleep 300) &\nwait\n"          # a server ignoring TERM
        proc = subprocess.Popen([*prefix, "bash", "-c", script], start_new_session=True)
        deadline = time.monotonic() + 10
        while not _sleeping(proc.pid) and time.monotonic() < deadline:    # TERM ignored by now
            time.sleep(0.05)
        left = stop(proc, name, grace_s=1.0)
        assert any("sleep 300" in line for line in left), left
        assert proc.returncode is not None          # the shell too: killed, reaped


def _sleeping(pid: int) -> bool:
    for child in children(pid):
        try:
            if Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep"):
                return True
        except OSError:
            pass
    return False
