"""Decode-side admission of one remote load for a long prompt on DeepSeek-V4-Flash's KV
layout (43 layers, block 256): what the scheduler and the connector do on the host before
the pull starts.

    python benchmarks/pd/admission.py [--tokens 855000]

  lookup:   prefix-cache lookup (hashes the prompt's 256-token blocks)
  allocate: allocate_slots with num_external_tokens (sliding groups: only the window's pages)
  plan:     plan_pages + descriptor_indices (int32 numpy, null sliding pages skipped)
  naive:    the same descriptors built the obvious way: a Python loop over every page of
            every group and layer, sliding history included, int64 lists
The V4 model is built on the meta device (no weights), only for its KV cache specs.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.kv_cache.groups import build_kv_cache_config
from wideserve.kv_cache.kv_cache_manager import KVCacheManager
from wideserve.disagg.layout import cdiv, descriptor_indices, group_plans, plan_pages, region_bases
from wideserve.types.request import Request
from wideserve.types.sampling_params import SamplingParams


def flash_specs() -> dict:
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=855_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    specs = flash_specs()
    n = args.tokens
    cache = CacheConfig(block_size=256, num_blocks_override=cdiv(n, 256) * 4 + 64)
    kv_config = build_kv_cache_config(specs, cache, SchedulerConfig(max_num_seqs=4))
    groups = group_plans(kv_config)
    base = region_bases([b.num_blocks for b in kv_config.buckets
                         for _ in range(b.num_slabs)])
    prompt = [(7 * i) % 120000 + 2 for i in range(n)]
    times: dict[str, list[float]] = {"lookup": [], "allocate": [], "plan": [], "naive": []}
    descs = 0
    for rep in range(args.repeats):
        kv = KVCacheManager(kv_config, cache, n + 16)
        req = Request(f"r{rep}", prompt, SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        hit, num_hit = kv.get_computed_blocks(req)
        t1 = time.perf_counter()
        assert kv.allocate_slots(req, 0, hit, num_hit, num_external_tokens=n - 1) is not None
        t2 = time.perf_counter()
        rows = kv.block_ids(req.request_id)
        local, remote = plan_pages(groups, rows, rows, 0, n - 1)
        idx = descriptor_indices(groups, base, local)
        descriptor_indices(groups, base, remote)
        t3 = time.perf_counter()
        # The naive build needs every page (no clipping): give sliding groups full rows.
        full_rows = [r if not g.is_sliding else list(range(1, cdiv(n - 1, g.block_size) + 1))
                     for g, r in zip(kv_config.groups, rows)]
        naive_descriptors(kv_config, full_rows, n - 1, base)     # local and remote sides
        naive_descriptors(kv_config, full_rows, n - 1, base)
        t4 = time.perf_counter()
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[k].append(dt)
        descs = len(idx)
        kv.free(req)
    naive_descs = len(naive_descriptors(kv_config, full_rows, n - 1, base))
    print(json.dumps({"tokens": n, "groups": len(kv_config.groups),
                      "descriptors": descs, "naive_descriptors": naive_descs,
                      **{f"{k}_ms": round(float(np.median(v)) * 1e3, 2)
                         for k, v in times.items()}}))


if __name__ == "__main__":
    main()
