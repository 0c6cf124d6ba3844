"""`wideserve info --plan`: weights per rank as wideserve actually holds them (checked against
the loaded model, with and without expert sharding) and the KV capacity arithmetic."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from wideserve.config import LoadConfig
from wideserve.entrypoints.cli import main as cli_main
from wideserve.entrypoints.info import describe_model
from wideserve.entrypoints.plan import GIB, PlanInputs, WeightBytes, plan_lines, weight_bytes
from wideserve.worker.model_loader import build_model, load_model, read_config, resolve_model_path
from wideserve.models.registry import resolve_model_class

DATA = Path(__file__).resolve().parents[1] / "data"


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _meta_bundled() -> torch.nn.Module:
    path = resolve_model_path(None)
    cfg = read_config(path)
    cls = resolve_model_class(cfg)
    return build_model(cls, cls.config_class.from_dict(cfg), torch.bfloat16,
                       torch.device("meta"))


def test_weight_bytes_match_the_loaded_model_per_rank() -> None:
    w = weight_bytes(_meta_bundled())
    assert w.experts > 0 and w.rest > 0 and w.host == 0
    full = load_model(LoadConfig(dtype="bfloat16", load_format="dummy")).model
    assert w.per_rank(1, True) == _param_bytes(full)
    shard = load_model(LoadConfig(dtype="bfloat16", load_format="dummy"),
                       expert_parallel=(2, 0)).model
    assert w.per_rank(2, True) == _param_bytes(shard)


def test_capacity_arithmetic() -> None:
    w = WeightBytes(experts=80 * GIB, rest=10 * GIB, host=0)
    p = PlanInputs(ranks=8, expert_parallel=True, memory_per_rank=100 * GIB, utilization=0.9,
                   max_model_len=1000, max_num_seqs=4)
    text = "\n".join(plan_lines(w, 1024.0, 1 << 20, p, "bfloat16", "auto"))
    assert "weights per rank:   20.00 GiB = routed experts 10.00 GiB (1/8 of 80.00 GiB)" in text
    left = 90 * GIB - 20 * GIB - 4 * (1 << 20)
    assert f"{int(left // 1024):,} tokens of context per rank" in text
    assert f"= {int(left // ((1 << 20) + 1024 * 1000)):,} requests at 1,000 tokens" in text
    assert "fewest DEP ranks for the weights alone: 1" in text      # 80 / (90 - 10)
    more = WeightBytes(experts=100 * GIB, rest=10 * GIB, host=0)
    assert "fewest DEP ranks for the weights alone: 2" in "\n".join(
        plan_lines(more, 1024.0, 0, p, "bfloat16", "auto"))
    tight = PlanInputs(1, True, 50 * GIB, 0.9, 1000, 4)
    assert "DOES NOT FIT" in "\n".join(plan_lines(w, 1024.0, 0, tight, "bfloat16", "auto"))


def test_v4_flash_plan_from_config_alone() -> None:
    text = describe_model(str(DATA / "deepseek-v4-flash"), "fp8", plan={
        "ranks": 8, "expert_parallel": True, "memory_per_rank": 141 * GIB,
        "utilization": 0.9, "max_model_len": 131072, "max_num_seqs": 64})
    m = re.search(r"weights per rank:\s+([\d.]+) GiB = routed experts ([\d.]+) GiB "
                  r"\(1/8 of ([\d.]+) GiB\) \+ the rest ([\d.]+) GiB", text)
    assert m, text
    per_rank, share, experts, rest = map(float, m.groups())
    assert share == pytest.approx(experts / 8, abs=0.01)
    assert per_rank == pytest.approx(share + rest, abs=0.02)
    # 256 routed experts x (43 layers + 1 MTP block) x 3 x 2048 x 4096 (model-arch.md), kept in
    # the checkpoint's MXFP4: half a byte per value plus one UE8M0 scale byte per 32 values
    assert experts == pytest.approx(256 * 44 * 3 * 2048 * 4096 * (0.5 + 1 / 32) / GIB, rel=0.01)
    assert "3,514 B/token" in text and "requests at 131,072 tokens" in text


def test_cli_plan_flags(capsys) -> None:
    assert cli_main(["info", str(DATA / "deepseek-v41-flash"), "--plan", "-dp", "16",
                     "--enable-expert-parallel", "--memory-per-rank", "180GiB"]) == 0
    out = capsys.readouterr().out
    assert "plan: DEP over 16 ranks" in out and "host memory:" in out
    # V4.1-Flash's config names no expert format: counted as its released MXFP4, kept packed
    assert ("as FP4 with scales, kept in the checkpoint's format (config.json names no expert "
            "format: the released checkpoint's)") in out
    assert "as loaded today" not in out and "if the experts were held" not in out
    assert cli_main(["info", "--plan", "--max-model-len", "999999999"]) == 1
    assert "exceeds the model's limit" in capsys.readouterr().err
