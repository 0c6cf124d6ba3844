"""Prefix caching on a hit: "keep" vs "replay" restoration of sliding-window and compressor
state (BENCHMARKS.md, "Prefix caching: keep vs replay").

Four engines in one process, timed runs interleaved (A B C D A B C D ...) so load changes on a
shared machine hit every configuration alike; the median of the repeats is reported:
  keep          CacheConfig.prefix_window_mode="keep"
  replay        "replay" with the engine's replay_tokens (DeepseekV4ForCausalLM defines no
                replay_depth, so EngineCore falls back to the number of KV groups: 7 x 63)
  replay-exact  "replay" at the exact bound windowed layers x (window - 1) = 4 x 63 (the class
                attribute replay_depth = 4 is set for that engine's construction only)
  off           no prefix caching: the reference for outputs and compute
Workloads: 32 requests sharing 1 (then 4) prefixes of 768 tokens (3 logical blocks; the bundled
model's context is 1024), distinct 64-token suffixes, 32 greedy output tokens, ignore_eos.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/history/prefix_window_modes.py
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from wideserve.bench.datasets import shared_prefix_requests, token_pool
from wideserve.bench.report import machine_info
from wideserve.bench.throughput import build_llm, median_result, reset_prefix_cache, \
    run_wideserve
from wideserve.config import CacheConfig, EngineConfig, LoadConfig
from wideserve.models.deepseek_v4.model import DeepseekV4ForCausalLM

OUT = Path(__file__).parents[1] / "results" / "prefix_window_modes.json"
MODES = ("keep", "replay", "replay-exact", "off")
REPEATS = 3


def _engine(mode: str, warm: int):
    cache = CacheConfig(enable_prefix_caching=mode != "off", kv_cache_memory=256 << 20,
                        prefix_window_mode="keep" if mode == "keep" else "replay")
    config = EngineConfig(load=LoadConfig(dtype="float32"), cache=cache)
    if mode == "replay-exact":
        DeepseekV4ForCausalLM.replay_depth = 4        # the bundled model's windowed layers
    try:
        return build_llm(config, warm)
    finally:
        if mode == "replay-exact":
            del DeepseekV4ForCausalLM.replay_depth


def main() -> int:
    torch.set_num_threads(1)
    pool = token_pool(4096, list(range(6)))
    llms = {m: _engine(m, int(pool[-1])) for m in MODES}
    out: dict = {"machine_start": machine_info(), "workloads": {}}
    identical = True
    for prefixes in (1, 4):
        reqs = shared_prefix_requests(32, prefixes, 768, 64, 32, seed=0, pool=pool)
        runs: dict[str, list] = {m: [] for m in MODES}
        tokens: dict[str, list] = {}
        loads = []
        for _ in range(REPEATS):
            for m in MODES:
                reset_prefix_cache(llms[m])
                res, tokens[m] = run_wideserve(llms[m], reqs)
                runs[m].append(res)
            loads.append(round(os.getloadavg()[0], 2))
        w: dict = {"loadavg_1min_after_each_round": loads, "modes": {}}
        for m in MODES:
            r = median_result(runs[m]).to_dict()
            r["all_elapsed_s"] = [x.elapsed_s for x in runs[m]]
            r["identical_to_off"] = tokens[m] == tokens["off"]
            identical &= r["identical_to_off"]
            w["modes"][m] = r
            pc, kv = r["prefix_cache"], r["kv_blocks"]
            print(f"prefixes={prefixes} {m:<13} {r['total_tokens_per_s']:7.0f} total tok/s "
                  f"({r['elapsed_s']:.2f} s) | computed {pc['prompt_tokens_computed']:5d} "
                  f"(replayed {pc['replayed_tokens']:5d}, replay_tokens "
                  f"{pc['replay_tokens']}) | hit {100 * pc['hit_rate']:5.1f}% | peak blocks "
                  f"{kv['peak_blocks_in_use']} ({kv['peak_bytes_in_use'] / 2**20:.1f} MiB), "
                  f"cached after {kv['cached_blocks_after']} "
                  f"({kv['cached_bytes_after'] / 2**20:.2f} MiB) | same as off: "
                  f"{r['identical_to_off']}")
        out["workloads"][f"{prefixes}_prefixes"] = w
    out["machine_end"] = machine_info()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
