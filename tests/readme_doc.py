"""README.md's fenced blocks and how the doc tests run them (tests/test_readme*.py).

Every ```bash / ```python block of the README is one of:
- ```bash doctest / ```python doctest: run, its output compared with the ```text output block
  right after it, where there is one (doctest's ELLIPSIS: `...` matches anything);
- ```bash server: servers started as a user would, each command as if in a terminal of its
  own; the ```bash doctest blocks after it (up to the next server block or `## ` heading) are
  its clients. The session runs in a network namespace of its own, so the README's fixed
  ports (8000, 8100, 8200, 29550) and addresses (10.0.0.1) are used as written and never
  meet another test's;
- a block whose first line is NOT_RUN ("# not run by the doc test: <why>"), visible to the
  reader: it needs what CI does not have (the network, a 284B checkpoint, a GPU);
- the Quick start's test command (after CI_MARKER): CI runs it, character for character.
"""
from __future__ import annotations

import contextlib
import doctest
import itertools
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^ *```(.*)$")
NOT_RUN = "# not run by the doc test:"
CI_MARKER = "<!-- ci-command"
# Paths a reader has and CI does not: the real checkpoint's directory holds, for the commands
# that read only its config.json, the same config.json as tests/data.
SUBSTITUTE = {"~/models/DeepSeek-V4-Flash": "tests/data/deepseek-v4-flash"}
# Addresses of the README's multi-node examples, put on the namespace's loopback device.
ADDRESSES = ("10.0.0.1",)
SERVER_START_S = 420           # 2 cores shared with other tests: DP ranks load one by one
CLIENT_TIMEOUT_S = 300
STOP_S = 60


@dataclass(frozen=True)
class Block:
    info: str
    text: str
    line: int


@dataclass
class Session:
    """A server block (None: the tour's server, or none) and the client blocks that use it,
    each with the output block that follows it (None: only its exit status is checked)."""

    server: Block | None
    section: str
    clients: list[tuple[Block, Block | None]] = field(default_factory=list)


def fenced_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        body, j = [], i + 1
        while not FENCE.match(lines[j]) or FENCE.match(lines[j]).group(1).strip():
            body.append(lines[j][indent:])
            j += 1
        blocks.append(Block(m.group(1).strip(), "\n".join(body) + "\n", i + 1))
        i = j + 1
    return blocks


def readme_blocks(text: str | None = None) -> list[Block]:
    return fenced_blocks(README.read_text() if text is None else text)


def section_of(text: str, line: int) -> str:
    """The `## ` heading above `line` (1-based)."""
    heads = [ln for ln in text.splitlines()[:line] if ln.startswith("## ")]
    return heads[-1][3:].strip() if heads else ""


def ci_block_line(text: str) -> int:
    return text[:text.index(CI_MARKER)].count("\n") + 2


def is_code(block: Block) -> bool:
    return block.info.split(" ")[0] in ("bash", "sh", "python", "console", "shell", "")


def output_after(blocks: list[Block], k: int) -> Block | None:
    nxt = blocks[k + 1] if k + 1 < len(blocks) else None
    return nxt if nxt is not None and nxt.info == "text output" else None


def sessions(text: str | None = None) -> list[Session]:
    """The README's bash doctest/server blocks grouped into sessions, in order."""
    text = README.read_text() if text is None else text
    blocks, out = fenced_blocks(text), []
    current: Session | None = None
    for k, block in enumerate(blocks):
        section = section_of(text, block.line)
        if current is not None and current.section != section:
            current = None
        if block.info == "bash server":
            current = Session(block, section)
            out.append(current)
        elif block.info == "bash doctest":
            if current is None:
                current = Session(None, section)
                out.append(current)
            current.clients.append((block, output_after(blocks, k)))
    return out


def matches(want: str, got: str) -> bool:
    def norm(s: str) -> str:
        return "\n".join(line.rstrip() for line in s.strip("\n").splitlines()) + "\n"
    return doctest.OutputChecker().check_output(norm(want), norm(got), doctest.ELLIPSIS)


def env(**extra: str) -> dict[str, str]:
    """The reader's shell: the venv's `wideserve` first on PATH, this checkout importable, one
    torch thread per process (2 shared cores: more threads only slow every process down)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            **extra}


def substitute(text: str) -> str:
    for a, b in SUBSTITUTE.items():
        text = text.replace(a, b)
    return text


# --- server blocks ---

def commands(script: str) -> list[str]:
    """The script's commands: continuation lines joined, comments and blank lines dropped."""
    out, pending = [], ""
    for line in script.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.strip() if pending else line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        out.append(pending.strip())
        pending = ""
    return out


def background_script(block: Block) -> str:
    """The server block as one script: each command put in the background (the reader types
    them into terminals of their own), `export`s kept in the shell that starts them."""
    lines = []
    for cmd in commands(substitute(block.text)):
        if cmd.startswith("export "):
            lines.append(cmd)
        else:
            lines.append(cmd if cmd.endswith("&") else cmd + " &")
    return "\n".join(lines + ["wait"]) + "\n"


def server_ports(block: Block) -> list[int]:
    """The HTTP ports the block's API servers and routers listen on (8000 unless --port)."""
    ports = []
    for cmd in commands(block.text):
        words = shlex.split(cmd.rstrip("&"))
        if "wideserve" not in words[:1] or "--headless" in words:
            continue
        ports.append(int(words[words.index("--port") + 1]) if "--port" in words else 8000)
    return ports


@contextlib.contextmanager
def namespace(name: str) -> Iterator[list[str]]:
    """A network namespace with only a loopback device (and ADDRESSES on it); yields the
    prefix that runs a command inside it. Needs root, as tests/disagg/test_nixl.py does."""
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=30)
        for address in ADDRESSES:
            subprocess.run(["ip", "-n", name, "addr", "add", f"{address}/32", "dev", "lo"],
                           check=True, timeout=30)
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def pids_in(name: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                         timeout=30).stdout
    return [int(p) for p in out.split()]


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(p) for p in (task / "children").read_text().split()]
    return kids


def wait_healthy(prefix: list[str], ports: list[int], proc: subprocess.Popen, log: Path
                 ) -> None:
    deadline = time.monotonic() + SERVER_START_S
    pending = list(ports)
    while pending:
        assert proc.poll() is None, f"the server block exited:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, \
            f"ports {pending} not healthy in {SERVER_START_S} s:\n{log.read_text()[-4000:]}"
        probe = subprocess.run([*prefix, "curl", "-sf", "-o", "/dev/null", "-m", "2",
                                f"http://127.0.0.1:{pending[0]}/health"], timeout=30)
        if probe.returncode == 0:
            pending.pop(0)
        else:
            time.sleep(0.5)


def stop(proc: subprocess.Popen, name: str, grace_s: float = STOP_S) -> list[str]:
    """As the README says: SIGTERM to each server (the shell's children); then every process of
    the namespace must be gone. Returns what was left (then killed), for the assertion."""
    for pid in children(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + grace_s / 4
    while pids_in(name) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = []
    for pid in pids_in(name):
        with contextlib.suppress(OSError):
            left.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes()
                        .replace(b"\0", b" ").decode(errors="replace")[:200])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    return left


_names = itertools.count()


def run_session(session: Session, workdir: Path, shown: list[str] | None = None) -> list[str]:
    """Start the session's server block in a namespace of its own, wait until every server
    answers /health, run each client block there; stop everything. Returns the failures."""
    assert session.server is not None
    name = f"wsreadme{os.getpid()}_{next(_names)}"
    log = workdir / "servers.log"
    failures: list[str] = []
    with namespace(name) as prefix, open(log, "w") as log_file:
        proc = subprocess.Popen([*prefix, "bash", "-c", background_script(session.server)],
                                cwd=workdir, env=env(), stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(prefix, server_ports(session.server), proc, log)
            for block, want in session.clients:
                failures += run_client(block, want, [*prefix], workdir, shown=shown)
        finally:
            left = stop(proc, name)
        if left:
            failures.append(f"README.md:{session.server.line}: processes left after SIGTERM "
                            f"to the servers: {left}\n{log.read_text()[-3000:]}")
    return failures


def run_client(block: Block, want: Block | None, prefix: list[str], cwd: Path,
               rewrite: dict[str, str] | None = None, shown: list[str] | None = None
               ) -> list[str]:
    """Run one client block; its failures (none: ran, and printed what the README shows).
    `shown` collects what it printed."""
    command = substitute(block.text)
    for a, b in (rewrite or {}).items():
        command = command.replace(a, b)
    proc = subprocess.run([*prefix, "bash", "-c", command], cwd=cwd, env=env(),
                          capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    if shown is not None:
        shown.append(f"README.md:{block.line}:\n{proc.stdout}{proc.stderr[-2000:]}")
    if proc.returncode != 0:
        return [f"README.md:{block.line}: exit status {proc.returncode}:\n"
                f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"]
    if want is not None and not matches(want.text, proc.stdout):
        return [f"README.md:{block.line} printed:\n{proc.stdout}\nthe README shows:\n{want.text}"]
    return []


if __name__ == "__main__":
    # `python tests/readme_doc.py LINE`: run the session whose server block starts at README
    # line LINE and print what each client block prints (to write its output block).
    import tempfile
    session = next(s for s in sessions() if s.server and s.server.line == int(sys.argv[1]))
    printed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        problems = run_session(session, Path(tmp), printed)
    print("\n".join(printed))
    print(f"{len(problems)} block(s) differ from the README")
