"""benchmarks/prefill_scaling.py: the prefill's ops per thread count - the dense GEMMs in one
row whichever kernel each count chose, each op's speed-up - and a real run on a tiny model."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.tiny_families import qwen3_moe_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/prefill_scaling.py"
spec = importlib.util.spec_from_file_location("prefill_scaling", SCRIPT)
scaling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scaling)


def _run(threads: int, wall: float, ops: dict[str, float]) -> dict:
    return {"threads": threads, "profiled_wall_ms": wall, "ops_ms": scaling._grouped(ops)}


def test_linears_are_one_row_and_each_op_has_its_speed_up() -> None:
    one = _run(1, 1000.0, {"wideserve::moe_fused_experts": 600.0,
                           "mkldnn::_linear_pointwise": 300.0, "wideserve::rms_norm": 40.0})
    # two threads: another kernel for the linears, the norm not scaling at all
    two = _run(2, 520.0, {"wideserve::moe_fused_experts": 300.0,
                          "wideserve::gemm_linear_brgemm": 100.0,
                          "mkldnn::_linear_pointwise": 50.0, "wideserve::rms_norm": 40.0,
                          "aten::copy_": 5.0})
    assert two["ops_ms"][scaling.LINEARS] == 150.0
    rows = {line.split(" | ")[0].lstrip("| "): line for line in scaling.table([one, two])}
    assert rows["wideserve::moe_fused_experts"].endswith("| 2.00x |")
    assert rows[scaling.LINEARS].endswith("| 2.00x |")
    assert "300.0 (30%)" in rows[scaling.LINEARS]
    assert rows["wideserve::rms_norm"].endswith("| 1.00x |")
    assert rows["aten::copy_"].endswith("| - |")          # absent at one thread
    assert rows["whole call"].endswith("| 1.92x |")
    assert "ideal 2" in scaling.table([one, two])[0]


def test_a_real_run_writes_a_line_per_count_and_the_table(tmp_path) -> None:
    model = qwen3_moe_checkpoint(
        tmp_path / "m", dtype=torch.bfloat16, vocab_size=512, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256)
    out = tmp_path / "runs.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(SCRIPT), model, "--threads", "1",
                           "--rounds", "1", "--num-prompts", "3", "--input-len", "40",
                           "--max-num-batched-tokens", "64", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert run["threads"] == 1 and run["max_num_batched_tokens"] == 64
    assert len(run["prompt_tok_s"]) == 1 and run["prompt_tok_s"][0] > 0
    assert run["ops_ms"][scaling.LINEARS] > 0 and run["profiled_wall_ms"] > 0
    assert "| whole call |" in done.stdout and "speed-up 1 -> 1" in done.stdout
