"""Decode-side admission of one remote load for a long prompt on DeepSeek-V4-Flash's KV
layout (43 layers, block 256) or Qwen3-30B-A3B's (48 full-attention layers): what the engine,
the scheduler and the connector do on the host before the pull starts.

    python benchmarks/pd/admission.py [--tokens 855000] [--model v4-flash|qwen3-moe]
    python benchmarks/pd/admission.py --ab main --tokens 131072 855000 [--model ...]

  create:   Request(...) from the prompt's Python int list (its int32 buffer, where it has one)
  checks:   what EngineCore.add_request and the P/D consumer check over the whole prompt: the
            id range, and the prompt digest a P/D handle is verified against (on the
            request's int32 buffer where it has one, else on the list, as before it had one)
  lookup:   prefix-cache lookup (hashes the prompt's 256-token blocks)
  allocate: allocate_slots with num_external_tokens (sliding groups: only the window's pages)
  plan:     plan_pages + descriptor_indices (int32 numpy, null sliding pages skipped)
  naive:    the same descriptors built the obvious way: a Python loop over every page of
            every group and layer, sliding history included, int64 lists
  admission = create + checks + lookup + allocate + plan: the host cost of admitting it.
The models are built on the meta device (no weights), only for their KV cache specs.

--ab REV: before/after in one run. REV's wideserve/ is exported (git archive) to a temporary
directory, and this script runs alternately against it and against this tree (fresh
processes, A B A B ...), one process per (tree, size, round); it prints the per-phase medians
of each tree and the ratio before/after.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.kv_cache.groups import build_kv_cache_config
from wideserve.kv_cache.kv_cache_manager import KVCacheManager
from wideserve.disagg.layout import cdiv, descriptor_indices, group_plans, plan_pages, region_bases
from wideserve.disagg.params import prompt_digest
from wideserve.types.request import Request
from wideserve.types.sampling_params import SamplingParams


REPO = Path(__file__).resolve().parents[2]
# Qwen3-30B-A3B (its config.json's attention and MoE shape).
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                 vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                 head_dim=128, num_experts=128, num_experts_per_tok=8,
                 moe_intermediate_size=768, max_position_embeddings=262144,
                 rope_theta=1e6, rms_norm_eps=1e-6, decoder_sparse_step=1,
                 mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False)


def qwen3_moe_specs() -> dict:
    from wideserve.models.qwen3_moe.model import Qwen3MoeConfig, Qwen3MoeForCausalLM
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(QWEN3_MOE))
    return model.kv_cache_specs("auto")


def flash_specs() -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from models.v4_configs import FLASH
    from wideserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from wideserve.models.deepseek_v4.config import DeepseekV4Config
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(FLASH))
    return model.kv_cache_specs("auto")


def naive_descriptors(kv_config, rows: list[list[int]], end: int, base: np.ndarray) -> np.ndarray:
    out: list[int] = []
    first = 0
    for g, row in zip(kv_config.groups, rows):
        regions = list(range(first, first + len(g.names)))
        first += len(g.names)
        for j in range(cdiv(end, g.block_size)):
            for r in regions:
                out.append(int(base[r]) + row[j])
    return np.array(out, dtype=np.int64)


def whole_prompt_checks(req: Request) -> str:
    """EngineCore.add_request's id range check and the consumer's prompt digest (a handle is
    verified against it); on the int32 buffer where the request has one (this tree)."""
    ids = req.prompt_array() if hasattr(req, "prompt_array") else req.prompt_token_ids
    lo, hi = (int(ids.min()), int(ids.max())) if isinstance(ids, np.ndarray) else (min(ids),
                                                                                    max(ids))
    assert 0 <= lo and hi < 1 << 30
    return prompt_digest(ids)


def measure(n: int, model: str, repeats: int, naive: bool) -> dict:
    torch.set_num_threads(1)
    specs = flash_specs() if model == "v4-flash" else qwen3_moe_specs()
    cache = CacheConfig(block_size=256, num_blocks_override=cdiv(n, 256) * 4 + 64)
    kv_config = build_kv_cache_config(specs, cache, SchedulerConfig(max_num_seqs=4))
    groups = group_plans(kv_config)
    base = region_bases([b.num_blocks for b in kv_config.buckets
                         for _ in range(b.num_slabs)])
    prompt = [(7 * i) % 120000 + 2 for i in range(n)]
    phases = ("create", "checks", "lookup", "allocate", "plan", "admission") + \
        (("naive",) if naive else ())
    times: dict[str, list[float]] = {k: [] for k in phases}
    descs = naive_descs = 0
    for rep in range(repeats):
        kv = KVCacheManager(kv_config, cache, n + 16)
        t0 = time.perf_counter()
        req = Request(f"r{rep}", prompt, SamplingParams(max_tokens=1))
        t1 = time.perf_counter()
        whole_prompt_checks(req)
        t1b = time.perf_counter()
        hit, num_hit = kv.get_computed_blocks(req)
        t2 = time.perf_counter()
        assert kv.allocate_slots(req, 0, hit, num_hit, num_external_tokens=n - 1) is not None
        t3 = time.perf_counter()
        rows = kv.block_ids(req.request_id)
        local, remote = plan_pages(groups, rows, rows, 0, n - 1)
        idx = descriptor_indices(groups, base, local)
        descriptor_indices(groups, base, remote)
        t4 = time.perf_counter()
        for k, dt in zip(phases, (t1 - t0, t1b - t1, t2 - t1b, t3 - t2, t4 - t3, t4 - t0)):
            times[k].append(dt)
        descs = len(idx)
        if naive:
            # The naive build needs every page (no clipping): give sliding groups full rows.
            full_rows = [r if not g.is_sliding else list(range(1, cdiv(n - 1, g.block_size) + 1))
                         for g, r in zip(kv_config.groups, rows)]
            t5 = time.perf_counter()
            naive_descs = len(naive_descriptors(kv_config, full_rows, n - 1, base))
            naive_descriptors(kv_config, full_rows, n - 1, base)    # local and remote sides
            times["naive"].append(time.perf_counter() - t5)
        kv.free(req)
    return {"model": model, "tokens": n, "groups": len(kv_config.groups),
            "descriptors": descs, **({"naive_descriptors": naive_descs} if naive else {}),
            **{f"{k}_ms": round(float(np.median(v)) * 1e3, 2) for k, v in times.items()}}


def export_tree(rev: str, into: str) -> str:
    """REV's wideserve/ package under `into` (what the A side imports)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "wideserve"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def ab(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trees = {f"before ({args.ab})": export_tree(args.ab, tmp), "after (this tree)": str(REPO)}
        results: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.rounds):
            for n in args.tokens:
                for label, root in trees.items():      # alternate: A B A B ...
                    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
                    out = subprocess.run(
                        [sys.executable, __file__, "--tokens", str(n), "--model", args.model,
                         "--repeats", str(args.repeats), "--no-naive"],
                        env=env, check=True, capture_output=True, text=True).stdout
                    results.setdefault((label, n), []).append(json.loads(out.splitlines()[-1]))
    phases = ("create", "checks", "lookup", "allocate", "plan", "admission")
    for n in args.tokens:
        rows = {}
        for label in trees:
            runs = results[(label, n)]
            rows[label] = {k: float(np.median([r[f"{k}_ms"] for r in runs])) for k in phases}
            print(json.dumps({"model": args.model, "tokens": n, "tree": label,
                              **{f"{k}_ms": round(v, 2) for k, v in rows[label].items()}}))
        before, after = rows.values()
        print(json.dumps({"model": args.model, "tokens": n, "speedup_before_over_after": {
            k: round(before[k] / after[k], 1) if after[k] else None for k in phases}}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[855_000])
    ap.add_argument("--model", choices=("v4-flash", "qwen3-moe"), default="v4-flash")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-naive", action="store_true", help="skip the naive descriptor build")
    ap.add_argument("--ab", metavar="REV", help="before/after against git revision REV")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: processes per tree and size")
    args = ap.parse_args()
    if args.ab:
        ab(args)
        return
    for n in args.tokens:
        print(json.dumps(measure(n, args.model, args.repeats, not args.no_naive)))


if __name__ == "__main__":
    main()
