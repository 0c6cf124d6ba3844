"""benchmarks/gpu/check.py without a GPU: its arguments, the comparison and report writer,
a `--device cpu` dry run end to end, and that the tests marked `gpu` are reported as skipped
for want of a GPU (not silently dropped) on a machine without one."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu/check.py")
check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = check
spec.loader.exec_module(check)


def test_arguments(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    args = check.parse_args([])
    assert args.device == "cuda" and args.families == ["v4", "v41", "qwen3moe"]
    assert args.batches == [1, 8, 64] and args.out == str(tmp_path)
    for bad in (["--families", "v4,llama9"], ["--batches", "1,x"], ["--batches", "0"]):
        with pytest.raises(SystemExit):
            check.parse_args(bad)


def test_first_mismatch() -> None:
    assert check.first_mismatch([[1, 2, 3]], [[1, 2, 3]]) is None
    assert check.first_mismatch([[1, 2], [5, 6, 7]], [[1, 2], [5, 9, 7]]) == 1
    assert check.first_mismatch([[1, 2]], [[1, 2, 3]]) == 2


def test_report_writer(tmp_path) -> None:
    args = check.parse_args(["--out", str(tmp_path), "--batches", "1,8"])
    results = [check.RunResult("v4", "reference", "cpu", tokens=[[3, 4]]),
               check.RunResult("v4", "eager", "cuda", tokens_match=True, syncs_per_step=2.5,
                               step_ms={1: 1.25, 8: 1.5}),
               check.RunResult("v4", "graphs", "cuda", tokens_match=False, first_mismatch=3,
                               captured=True, step_ms={1: 0.5}),
               check.RunResult("v41", "eager", "cuda", ok=False, error="RuntimeError: x")]
    meta = {"device": "cuda", "dtype": "float32", "max_tokens": 16, "torch": "2.x",
            "when": "now", "device_name": "H200"}
    out = check.write_report(results, args, meta)
    data = json.loads((out / "check.json").read_text())
    assert data["meta"]["device_name"] == "H200" and len(data["results"]) == 4
    md = (out / "check.md").read_text()
    assert "| v4 | eager | cuda | yes | True | - | 2.5 | 1.25 | 1.5 |" in md
    assert "| v4 | graphs | cuda | yes | no (from token 3) | True | - | 0.5 | - |" in md
    assert "FAIL: RuntimeError: x" in md
    assert check.failed(results) and not check.failed(results[:2])


def test_cpu_dry_run_end_to_end(tmp_path) -> None:
    rc = check.main(["--device", "cpu", "--families", "qwen3moe", "--batches", "1,2",
                     "--prompts", "2", "--prompt-len", "8", "--max-tokens", "3",
                     "--out", str(tmp_path)])
    data = json.loads((tmp_path / "check.json").read_text())
    runs = {r["run"]: r for r in data["results"]}
    assert set(runs) == {"reference", "eager", "graphs"}
    assert all(r["ok"] for r in runs.values()), runs
    assert runs["eager"]["tokens"] == runs["reference"]["tokens"]      # cpu fp32 both
    assert len(runs["reference"]["tokens"]) == 2 and len(runs["reference"]["tokens"][0]) == 3
    assert set(runs["graphs"]["step_ms"]) == {"1", "2"} and runs["eager"]["syncs_per_step"] is None
    assert runs["graphs"]["captured"] is True and runs["eager"]["captured"] is False
    assert rc == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: they run")
def test_gpu_tests_are_reported_skipped_for_no_gpu() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-n", "0", "-rs",
                           "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:]
    # Every test there skipped (however many the gpu suite holds), none run.
    assert re.search(r"\b\d+ skipped in", done.stdout), done.stdout[-2000:]
    assert " passed" not in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]
    assert "no CUDA device on this machine" in done.stdout
