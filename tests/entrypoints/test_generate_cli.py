"""`wideserve generate` as a real process on the bundled model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def wideserve(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "wideserve.entrypoints.cli", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_generate_prints_text_for_each_prompt():
    res = wideserve("generate", "--prompt", "ROMEO.\n", "--prompt", "JULIET.\n",
                    "--max-tokens", "8", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if "->" in ln]
    assert len(lines) == 2
    assert all("(8 tokens, finish: length)" in ln or "finish: stop" in ln for ln in lines)


def test_bad_flag_values_name_the_flag():
    res = wideserve("generate", "--prompt", "x", "--temperature", "-1")
    assert res.returncode == 2 and "--temperature" in res.stderr
    res = wideserve("generate", "--prompt", "x", "--max-num-seqs", "zero")
    assert res.returncode == 2 and "--max-num-seqs" in res.stderr
    res = wideserve("generate", "/nonexistent/model", "--prompt", "x")
    assert res.returncode == 1 and "does not exist" in res.stderr
