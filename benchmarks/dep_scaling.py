"""DEP1 / DEP2 / DEP4 on a many-expert Qwen3-MoE (dummy weights) at a fixed per-rank load.

For each size N: N engine-core processes (N = 1: one in-process engine), `--per-rank` requests
per rank submitted at once (prompt `--prompt-len`, `--output-len` tokens, greedy, EOS ignored).
Reports per-rank output throughput, P50/P90 tokens/s per user (decode rate of each request),
the per-step time split (compute = forward minus all-to-all; all-to-all; DP sync; host =
schedule + prepare + sample + output), the step-sync calibration (gloo vs recursive doubling),
and, at the largest N, the prefix-cache hit rate with and without prefix affinity on a
shared-prefix workload. JSON to --out.

    python benchmarks/dep_scaling.py --sizes 1 2 4 --out benchmarks/results/dep_scaling.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from wideserve import LLM, SamplingParams

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 2048,
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu",
}


def _free_port_block(n: int) -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    return base if base + n < 65535 else 20000


def _llm(model: str, dp: int, args: argparse.Namespace) -> LLM:
    kw = dict(load_format="dummy", dtype="float32", skip_tokenizer_init=True,
              block_size=32, max_num_seqs=args.per_rank, max_num_batched_tokens=2048,
              kv_cache_memory=256 << 20)
    if dp > 1:
        kw.update(data_parallel_size=dp, enable_expert_parallel=True,
                  data_parallel_rpc_port=_free_port_block(2 + 2 * dp))
    return LLM(model, **kw)


def _prompts(n: int, length: int, seed: int, shared: int = 0, groups: int = 1):
    """n prompts; with shared > 0, prompt i starts with the shared head of group i % groups
    (the same heads for every seed)."""
    head_gen = torch.Generator().manual_seed(12345)
    heads = [torch.randint(2, CONFIG["vocab_size"], (shared,), generator=head_gen).tolist()
             for _ in range(groups)]
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": heads[i % groups] + torch.randint(
        2, CONFIG["vocab_size"], (length - shared,), generator=gen).tolist()} for i in range(n)]


def _split(rank_stats: list[dict]) -> dict:
    """Mean per-step seconds over ranks: compute, all-to-all, DP sync, host."""
    out = []
    for s in rank_stats:
        sec = s["steps"]["seconds"]
        dp = s.get("dp") or {}
        steps = max(1, s["steps"]["steps"] + dp.get("dummy_steps", 0))
        a2a = dp.get("a2a_s", 0.0)
        busy_syncs = max(1, dp.get("sync_count", 0) - dp.get("idle_syncs", 0))
        out.append({
            "compute_ms": 1e3 * (sec["forward"] - a2a) / steps,
            "all_to_all_ms": 1e3 * a2a / steps,
            "dp_sync_ms": 1e3 * dp.get("sync_s", 0.0) / busy_syncs,
            "host_ms": 1e3 * sum(sec[k] for k in ("schedule", "prepare", "sample", "output"))
            / steps,
            "steps": steps,
        })
    return {k: statistics.mean(o[k] for o in out) for k in out[0]}


def run_size(model: str, dp: int, args: argparse.Namespace) -> dict:
    llm = _llm(model, dp, args)
    try:
        n = args.per_rank * dp
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(_prompts(dp, args.prompt_len, seed=99), sp, use_tqdm=False)   # warm-up
        start = time.perf_counter()
        outs = llm.generate(_prompts(n, args.prompt_len, seed=1), sp, use_tqdm=False)
        wall = time.perf_counter() - start
        per_user = sorted(
            (o.metrics.num_generation_tokens - 1) / (o.metrics.last_token_time
                                                     - o.metrics.first_token_time)
            for o in outs if o.metrics.last_token_time > o.metrics.first_token_time)
        stats = llm.engine.get_stats()
        ranks = stats.get("per_rank", [stats]) if dp > 1 else [_stats_dict(llm)]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {
            "dp": dp, "requests": n, "output_tokens": tokens, "wall_s": wall,
            "tok_s_per_rank": tokens / wall / dp,
            "p50_user_tok_s": statistics.median(per_user),
            "p90_user_tok_s": per_user[int(0.1 * (len(per_user) - 1))],  # P90 = 10th pct
            "step_split": _split(ranks),
        }
        if dp > 1:
            row["sync"] = {"method": ranks[0]["dp"]["sync_method"],
                           "calibration_us": ranks[0]["dp"]["sync_calibration_us"]}
        return row
    finally:
        llm.shutdown()


def _stats_dict(llm: LLM) -> dict:
    from wideserve.engine import engine_ipc as ipc
    return ipc.to_builtins(llm.engine.get_stats())


def affinity(model: str, dp: int, args: argparse.Namespace) -> dict:
    """Prefix hit rate at DP=dp on `groups` groups of prompts sharing a 256-token prefix,
    sent in two waves (the second wave can hit what the first cached), with and without
    affinity. A group count that does not divide dp keeps plain balancing from aligning
    groups with ranks by accident (round-robin over i % dp vs groups i % groups)."""
    out = {}
    for on in (False, True):
        llm = _llm(model, dp, args)
        try:
            llm.engine.client.balancer.prefix_affinity = on
            llm.engine.client.balancer.affinity_block = 32
            sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            for wave in range(2):
                prompts = _prompts(4 * dp, 320, seed=10 + wave, shared=256,
                                   groups=args.affinity_groups)
                # Arrival order is random in real traffic: without the shuffle, plain
                # balancing sends prompt i to rank i % dp in both waves (an accidental
                # affinity).
                order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(
                    wave)).tolist()
                llm.generate([prompts[i] for i in order], sp, use_tqdm=False)
            s = llm.engine.get_stats()
            out["on" if on else "off"] = {"hit_rate": s["prefix_hits"] / s["prefix_queries"],
                                          "picks": llm.engine.client.balancer.picks}
        finally:
            llm.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--per-rank", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--affinity-groups", type=int, default=8)
    parser.add_argument("--only-affinity", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/dep_scaling.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(CONFIG))
        rows = [] if args.only_affinity else [run_size(tmp, dp, args) for dp in args.sizes]
        for r in rows:
            s = r["step_split"]
            print(f"DEP{r['dp']}: {r['tok_s_per_rank']:.1f} tok/s/rank, P90 user "
                  f"{r['p90_user_tok_s']:.1f} tok/s, step: compute {s['compute_ms']:.1f} ms, "
                  f"a2a {s['all_to_all_ms']:.1f} ms, sync {s['dp_sync_ms']:.2f} ms, host "
                  f"{s['host_ms']:.1f} ms  {r.get('sync', '')}", flush=True)
        aff = affinity(tmp, max(d for d in args.sizes), args) if max(args.sizes) > 1 else None
        print("prefix affinity:", aff)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other "
                         f"jobs), torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "config": CONFIG, "args": vars(args), "sizes": rows, "affinity": aff}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
