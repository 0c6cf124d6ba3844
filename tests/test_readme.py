"""README.md works as written (tests/readme_doc.py says how each kind of block is run).

This module: the tour's first blocks against one `wideserve serve` of the bundled model (the
Quick start's server, on a free port instead of 8000), the python blocks in order in one
interpreter as a reader pasting them would, the blocks that need no server, and that every
command block of the README is run by a doc test or says why not. The blocks that start
servers of their own run in tests/test_readme_servers.py."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from ports import free_port

from readme_doc import (CI_MARKER, NOT_RUN, README, ROOT, Block, ci_block_line, env,
                        fenced_blocks, is_code, matches, output_after, readme_blocks,
                        run_client, sessions)

SEPARATOR = "--- README block ---"
TOUR_SECTION = "A tour"


def _free_port() -> int:
    return free_port()          # outside the ephemeral range (tests/ports.py)


@pytest.fixture(scope="module")
def server_port():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "wideserve.entrypoints.cli", "serve",
                             "--port", str(port)], cwd=ROOT, env=env(),
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


def _python_pairs() -> list[tuple[Block, Block]]:
    blocks = readme_blocks()
    pairs = []
    for k, block in enumerate(blocks):
        if block.info == "python doctest":
            want = output_after(blocks, k)
            assert want is not None, \
                f"README.md:{block.line}: a python doctest block needs a ```text output block"
            pairs.append((block, want))
    return pairs


SESSIONS = sessions()
TOUR = [pair for s in SESSIONS if s.server is None and s.section == TOUR_SECTION
        for pair in s.clients]
STANDALONE = [pair for s in SESSIONS if s.server is None and s.section != TOUR_SECTION
              for pair in s.clients]
PYTHON = _python_pairs()


def test_the_readme_has_a_tour() -> None:
    assert len(TOUR) >= 3 and len(PYTHON) >= 2
    assert any("curl" in b.text for b, _ in TOUR) and any("wideserve " in b.text for b, _ in TOUR)
    assert all(want is not None for _, want in TOUR)


@pytest.mark.parametrize("block,want", TOUR, ids=[f"line{b.line}" for b, _ in TOUR])
def test_bash_block(block: Block, want: Block, server_port: int) -> None:
    failures = run_client(block, want, [], ROOT,
                          rewrite={"127.0.0.1:8000": f"127.0.0.1:{server_port}"})
    assert not failures, failures[0]


@pytest.mark.parametrize("block,want", STANDALONE, ids=[f"line{b.line}" for b, _ in STANDALONE])
def test_block_without_a_server(block: Block, want: Block | None) -> None:
    failures = run_client(block, want, [], ROOT)
    assert not failures, failures[0]


@pytest.fixture(scope="module")
def python_outputs() -> list[str]:
    script = "\n".join(f"{b.text}\nprint({SEPARATOR!r}, flush=True)" for b, _ in PYTHON)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split(SEPARATOR + "\n")[:len(PYTHON)]


@pytest.mark.parametrize("index", range(len(PYTHON)),
                         ids=[f"line{b.line}" for b, _ in PYTHON])
def test_python_block(index: int, python_outputs: list[str]) -> None:
    block, want = PYTHON[index]
    got = python_outputs[index]
    assert matches(want.text, got), \
        f"README.md:{block.line} printed:\n{got}\nthe README shows:\n{want.text}"


def unaccounted(text: str) -> list[str]:
    """README blocks that no doc test runs and that do not say why (NOT_RUN), and output
    blocks that follow no block that is run."""
    blocks = fenced_blocks(text)
    ran = {b.line for s in sessions(text) for b, _ in s.clients}
    ran |= {s.server.line for s in sessions(text) if s.server is not None}
    ran |= {b.line for b in blocks if b.info == "python doctest"}
    ran.add(ci_block_line(text) if CI_MARKER in text else -1)
    bad = []
    for k, block in enumerate(blocks):
        if block.info == "text output":
            if k == 0 or blocks[k - 1].line not in ran:
                bad.append(f"README.md:{block.line}: an output block after no block that runs")
        elif block.line in ran:
            continue
        elif not is_code(block):
            bad.append(f"README.md:{block.line}: ```{block.info}: not a kind the doc test "
                       "knows (bash doctest, bash server, python doctest, text output)")
        elif not block.text.startswith(NOT_RUN):
            bad.append(f"README.md:{block.line}: neither run by the doc test nor marked "
                       f"'{NOT_RUN} <why>'")
    return bad


def test_every_command_block_is_run_or_says_why_not() -> None:
    assert unaccounted(README.read_text()) == []


def test_unaccounted_finds_blocks_that_would_silently_not_run() -> None:
    text = ("## A tour\n```bash\nwideserve serve --port 1\n```\n"
            f"```bash\n{NOT_RUN} a GPU\nwideserve serve\n```\n"
            "```bash doctest\ncurl x\n```\n```text output\nx\n```\n"
            "```json\n{}\n```\n```bash\necho\n```\n```text output\nlost\n```\n")
    assert [b.split(":")[1] for b in unaccounted(text)] == ["2", "15", "18", "21"]


def test_quick_start_test_command_is_what_ci_runs() -> None:
    text = README.read_text()
    block = fenced_blocks(text[text.index(CI_MARKER):])[0]
    assert ci_block_line(text) == next(b.line for b in fenced_blocks(text)
                                       if b.text == block.text)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert block.text.strip() == ci.strip()


def test_fenced_blocks_parser() -> None:
    text = "a\n```bash doctest\necho hi\n```\n\n  ```text output\n  hi\n  ```\n"
    blocks = fenced_blocks(text)
    assert blocks == [Block("bash doctest", "echo hi\n", 2), Block("text output", "hi\n", 6)]
    assert matches("x ... z\n", "x yyy z") and not matches("x z\n", "x y z")
