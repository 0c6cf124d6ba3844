"""README.md's tour works as written: every fenced block tagged `doctest` (```bash doctest,
```python doctest) is run and its output compared with the ```text output block that follows
it (doctest's ELLIPSIS: `...` matches anything). Bash blocks run against one `wideserve serve`
of the bundled model for the module (the Quick start's server, on a free port instead of
8000); python blocks run in order in one interpreter, as a reader pasting them would. Also:
the Quick start's test command is the command CI runs."""
from __future__ import annotations

import doctest
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^ *```(.*)$")
SEPARATOR = "--- README block ---"


@dataclass(frozen=True)
class Block:
    info: str
    text: str
    line: int


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


def doctest_pairs(kind: str) -> list[tuple[Block, Block]]:
    blocks = fenced_blocks(README.read_text())
    pairs = []
    for k, block in enumerate(blocks):
        if block.info == f"{kind} doctest":
            following = blocks[k + 1] if k + 1 < len(blocks) else None
            assert following is not None and following.info == "text output", \
                f"README.md:{block.line}: a doctest block needs a ```text output block after it"
            pairs.append((block, following))
    return pairs


def _matches(want: str, got: str) -> bool:
    def norm(s: str) -> str:
        return "\n".join(line.rstrip() for line in s.strip("\n").splitlines()) + "\n"
    return doctest.OutputChecker().check_output(norm(want), norm(got), doctest.ELLIPSIS)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_port():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "wideserve.entrypoints.cli", "serve",
                             "--port", str(port)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the README's server did not become healthy in 300 s")
        yield port
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


BASH = doctest_pairs("bash")
PYTHON = doctest_pairs("python")


def test_the_readme_has_a_tour() -> None:
    assert len(BASH) >= 3 and len(PYTHON) >= 2
    assert any("curl" in b.text for b, _ in BASH) and any("wideserve " in b.text for b, _ in BASH)


@pytest.mark.parametrize("block,want", BASH, ids=[f"line{b.line}" for b, _ in BASH])
def test_bash_block(block: Block, want: Block, server_port: int) -> None:
    command = block.text.replace("127.0.0.1:8000", f"127.0.0.1:{server_port}")
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"README.md:{block.line}: {proc.stderr[-2000:]}"
    assert _matches(want.text, proc.stdout), \
        f"README.md:{block.line} printed:\n{proc.stdout}\nthe README shows:\n{want.text}"


@pytest.fixture(scope="module")
def python_outputs() -> list[str]:
    script = "\n".join(f"{b.text}\nprint({SEPARATOR!r}, flush=True)" for b, _ in PYTHON)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split(SEPARATOR + "\n")[:len(PYTHON)]


@pytest.mark.parametrize("index", range(len(PYTHON)),
                         ids=[f"line{b.line}" for b, _ in PYTHON])
def test_python_block(index: int, python_outputs: list[str]) -> None:
    block, want = PYTHON[index]
    got = python_outputs[index]
    assert _matches(want.text, got), \
        f"README.md:{block.line} printed:\n{got}\nthe README shows:\n{want.text}"


def test_quick_start_test_command_is_what_ci_runs() -> None:
    text = README.read_text()
    marker = text.index("<!-- ci-command")
    block = next(b for b in fenced_blocks(text[marker:]))
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert block.text.strip() == ci.strip()


def test_fenced_blocks_parser() -> None:
    text = "a\n```bash doctest\necho hi\n```\n\n  ```text output\n  hi\n  ```\n"
    blocks = fenced_blocks(text)
    assert blocks == [Block("bash doctest", "echo hi\n", 2), Block("text output", "hi\n", 6)]
    assert _matches("x ... z\n", "x yyy z") and not _matches("x z\n", "x y z")
