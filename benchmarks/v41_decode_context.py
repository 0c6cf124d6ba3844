"""Decode step time against context length: DeepSeek-V4.1 vs DeepSeek-V4 (BENCHMARKS.md,
"DeepSeek-V4.1: decode step time vs context").

Two dummy models of the same width (hidden 256, 8 heads x 128, window 128, index_topk 512,
12 layers, 8 routed experts top-2), built with wideserve's dummy weights:
  V4    2 SWA + 5 CSA (ratio 4, own indexer) + 5 HCA (ratio 128), alternating
  V4.1  2 SWA, ratio-2 source at 2 reused by 3-5, ratio-1 source at 6 (candidate source,
        2,048 blocks of 8) reused by 7, 9, 11 and re-indexed at 8 and 10 (V4.1-Flash's
        pattern scaled down: only 2 of 10 compressed layers own KV)
One request decodes one token on top of a cache that holds `context` positions of random
(finite) content: the caches are filled directly instead of by a prefill, which on this CPU
would dominate the run; a decode step's cost depends on how much it reads, not on the values.
Sliding-window caches (windows, compressor state) get a ring of RING blocks (block i of the
request -> physical block 1 + i % RING), as the engine frees blocks behind a window, so only
the growing caches scale with the context and 1M positions fit in memory. Both models store
fp32 values (V4 "auto" on an fp32 model, V4.1 "raw": the same quantised values as its
records), so neither pays a dtype conversion or record unpacking the other does not.
Per context: 2 warm-up steps, then the median of 7 steps; V4 and V4.1 alternate at each
context so load on the shared machine hits both alike.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/v41_decode_context.py [max_context]
        [--only v41|v4]
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from wideserve.bench.report import machine_info
from wideserve.kv_cache.spec import CacheKind, split_shared
from wideserve.worker.dummy_weights import init_dummy_weights
from wideserve.types.forward_batch import ForwardBatch, KVGroupView
from wideserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
from wideserve.models.deepseek_v4.config import DeepseekV4Config
from wideserve.models.deepseek_v41.model import DeepseekV41ForCausalLM
from wideserve.models.deepseek_v41.config import DeepseekV41Config

OUT = Path(__file__).parent / "results" / "v41_decode_context.json"
BLOCK = 256
RING = 2      # blocks of a sliding-window cache (window 128 + the new token fit in 2 x 256)
CONTEXTS = (2048, 8192, 32768, 131072, 262144, 524288, 1048576)
COMMON = dict(vocab_size=1024, hidden_size=256, moe_intermediate_size=128,
              num_hidden_layers=12, num_attention_heads=8, head_dim=128, q_lora_rank=128,
              o_groups=2, o_lora_rank=64, n_routed_experts=8, num_experts_per_tok=2,
              sliding_window=128, index_n_heads=8, index_head_dim=64, index_topk=512,
              hc_mult=4, hc_sinkhorn_iters=20, max_position_embeddings=1 << 20)


def v4_model() -> DeepseekV4ForCausalLM:
    ratios = [0, 0] + [4, 128] * 5
    cfg = DeepseekV4Config.from_dict(dict(COMMON, compress_ratios=ratios + [0],
                                          qk_rope_head_dim=32, num_nextn_predict_layers=0,
                                          num_hash_layers=0))
    return _dummy(DeepseekV4ForCausalLM(cfg))


def v41_model() -> DeepseekV41ForCausalLM:
    cfg = DeepseekV41Config(**COMMON, qk_rope_head_dim=32,
                            compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1],
                            kv_source_layer_ids=[2, 6], index_source_layer_ids=[2, 6, 8, 10],
                            candidate_source_layer_id=6, candidate_topk_blocks=2048,
                            candidate_block_size=8, engram_layer_ids=[],
                            engram_num_embeddings=[], rms_norm_eps=1e-6)
    cfg.validate()
    return _dummy(DeepseekV41ForCausalLM(cfg))


def _dummy(model):
    model = model.float().eval()
    init_dummy_weights(model, seed=0)
    return model


class OneRequest:
    """Caches for one request of up to `max_len` positions; block table = 1..n."""

    def __init__(self, model, max_len: int, kv_cache_dtype: str) -> None:
        self.model = model
        owned, shared = split_shared(model.kv_cache_specs(kv_cache_dtype))
        self.blocks = math.ceil(max_len / BLOCK) + 1
        self.groups, self.cache_group, self.caches = [], {}, {}
        g = torch.Generator().manual_seed(0)
        for name, spec in owned.items():
            if spec not in self.groups:
                self.groups.append(spec)
            self.cache_group[name] = self.groups.index(spec)
            ring = spec.kind == CacheKind.SLIDING_WINDOW
            shape = (RING + 1 if ring else self.blocks + 1, BLOCK // spec.compress_ratio,
                     spec.width)
            self.caches[name] = (torch.randn(shape, generator=g) * 0.5).to(spec.dtype)
        for name, owner in shared.items():
            self.caches[name] = self.caches[owner]
            self.cache_group[name] = self.cache_group[owner]

    def decode(self, position: int) -> float:
        blocks = torch.arange(self.blocks, dtype=torch.int64)[None]
        pos = torch.tensor([position])
        views = []
        for spec in self.groups:
            ring = spec.kind == CacheKind.SLIDING_WINDOW
            view = KVGroupView(BLOCK, spec.compress_ratio, 1 + (blocks % RING if ring else blocks))
            if spec.compress_ratio == 1:
                view.slot_mapping = view.entry_slots(torch.zeros(1, dtype=torch.int64), pos)
            views.append(view)
        qsl = np.array([0, 1])
        seq = np.array([position + 1])
        batch = ForwardBatch(input_ids=torch.tensor([7]), positions=pos,
                             query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq),
                             query_start_loc_cpu=qsl, seq_lens_cpu=seq, kv_caches=self.caches,
                             kv_groups=views, cache_group=self.cache_group)
        t = time.perf_counter()
        with torch.inference_mode():
            self.model.compute_logits(self.model.forward(batch))
        return time.perf_counter() - t


def main() -> None:
    torch.set_num_threads(1)
    args = sys.argv[1:]
    only = args[args.index("--only") + 1] if "--only" in args else None
    top = int(args[0]) if args and args[0].isdigit() else 131072
    contexts = [c for c in CONTEXTS if c <= top]
    models = {k: build() for k, build in (("v4", v4_model), ("v41", v41_model))
              if only in (None, k)}
    rows = []
    for ctx in contexts:
        reqs = {k: OneRequest(m, ctx + 16, "auto" if k == "v4" else "raw")
                for k, m in models.items()}
        times = {k: [] for k in models}
        for i in range(9):
            for k, r in reqs.items():
                dt = r.decode(ctx + (i % 8))
                if i >= 2:
                    times[k].append(dt)
        row = {"context": ctx, **{f"{k}_ms": 1000 * float(np.median(v)) for k, v in times.items()}}
        rows.append(row)
        print(row, flush=True)
        del reqs
    base = rows[0]
    for r in rows:
        for k in models:
            r[f"{k}_vs_first"] = r[f"{k}_ms"] / base[f"{k}_ms"]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": machine_info(), "rows": rows,
                               "command": " ".join(sys.argv)}, indent=1))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
