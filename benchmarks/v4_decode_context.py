"""DeepSeek-V4 decode step time against context length, a batch of a few requests (BENCHMARKS.md,
"DeepSeek-V4: decode step time at 2K vs 32K context").

The model is benchmarks/v41_decode_context.py's V4 (hidden 256, 8 heads x 128, window 128,
index_topk 512, 12 layers: 2 sliding + 5 CSA(4) + 5 HCA(128), 8 experts top-2: V4-Flash's
shape scaled down), built with wideserve's dummy weights in the model dtype (bf16 by default,
fp32 for the parameters the loader keeps in fp32). Each request decodes one token on top of a
cache holding its `context` positions of random finite content, filled directly rather than by
a prefill (a decode step's cost depends on how much it reads, not on the values); only the
blocks a step can read are allocated for the per-position groups (window, compressor state),
the others point at block 0, as the KV manager's freed sliding-window pages do.

Scenarios (name: contexts of the batch's requests): short (4 x 2K), long (4 x 32K) and mixed
(1 x 32K + 3 x 2K: what padding to the longest context costs). Per scenario: 2 warm-up steps,
then the median of `--steps` steps. `--interleave` keeps every scenario's batch alive and
round-robins single steps over all (scenario, indexer path) pairs: on a shared machine the
ratios then compare steps taken under the same load.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/v4_decode_context.py [--dtype bf16]
        [--steps 7] [--indexer fused torch] [--interleave] [--out benchmarks/results/v4_decode_context.jsonl] [--tag after]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from wideserve.bench.report import machine_info
from wideserve.kv_cache.spec import split_shared
from wideserve.worker.dummy_weights import init_dummy_weights
from wideserve.types.forward_batch import ForwardBatch, KVGroupView
from wideserve.worker.model_loader import build_model
from wideserve.models.deepseek_v4.model import DeepseekV4ForCausalLM

HERE = Path(__file__).parent
SCENARIOS = {"short": [2048] * 4, "long": [32768] * 4, "mixed": [32768, 2048, 2048, 2048]}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _v41_bench():
    """benchmarks/v41_decode_context.py as a module (its V4 config and block size)."""
    spec = importlib.util.spec_from_file_location("v41_decode_context",
                                                  HERE / "v41_decode_context.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def v4_model(dtype: torch.dtype) -> DeepseekV4ForCausalLM:
    """The V4 of v41_decode_context.py, loaded the engine's way in `dtype`."""
    cfg = _v41_bench().v4_model().config
    model = build_model(DeepseekV4ForCausalLM, cfg, dtype, torch.device("cpu"))
    init_dummy_weights(model, seed=0)
    return model


def set_precision(model, attn, index) -> None:
    """Override the attention products' and the indexer's dtype on every layer ("model": the
    model dtype; None: back to the defaults, docs/deepseek_v4.md "Attention precision")."""
    attn, index = (model.dtype if d == "model" else d for d in (attn, index))
    for layer in [*model.model.layers, *model.mtp]:
        layer.self_attn.dtype_override = attn
        indexer = getattr(getattr(layer.self_attn, "compressor", None), "indexer", None)
        if indexer is not None:
            indexer.dtype_override = index


def set_indexer_path(model, fused: bool) -> None:
    """The CSA indexer's scoring: the fused CPU op (the default where it runs) or the torch
    bucket loop (v4_batched.select)."""
    for layer in model.model.layers:
        indexer = getattr(getattr(layer.self_attn, "compressor", None), "indexer", None)
        if indexer is not None:
            indexer.use_cpu_kernel = fused


class Batch:
    """Paged caches for a few requests, block table rows 0..R-1, and steps over them."""

    def __init__(self, model: DeepseekV4ForCausalLM, contexts: list[int], block: int,
                 extra: int = 16) -> None:
        """Requests holding `contexts` positions of random content, room for `extra` more."""
        self.model, self.contexts, self.block = model, contexts, block
        self.lengths = list(contexts)       # positions held per request (grows as it runs)
        c = model.config     # how far back a step reads per-position rows (window, state)
        self.reach = 2 * max([c.sliding_window] + [c.compress_ratio(i)
                                                   for i in range(c.num_hidden_layers)])
        owned, shared = split_shared(model.kv_cache_specs("auto"))
        width = math.ceil((max(contexts) + extra) / block)
        self.groups, self.cache_group, self.caches, self.tables = [], {}, {}, []
        g = torch.Generator().manual_seed(0)
        for name, spec in owned.items():
            if spec not in self.groups:
                self.groups.append(spec)
                self.tables.append(self._table(spec.compress_ratio, width, extra))
            gi = self.groups.index(spec)
            self.cache_group[name] = gi
            shape = (int(self.tables[gi].max()) + 1, block // spec.compress_ratio, spec.width)
            self.caches[name] = (torch.randn(shape, generator=g) * 0.5).to(spec.dtype)
        for name, owner in shared.items():
            self.caches[name] = self.caches[owner]
            self.cache_group[name] = self.cache_group[owner]

    def _table(self, ratio: int, width: int, extra: int) -> torch.Tensor:
        """Block ids per request: every block for growing groups; for per-position groups
        (ratio 1: window, state) only the blocks from one window before the context on."""
        table = np.zeros((len(self.contexts), width), dtype=np.int64)
        next_id = 1
        for r, ctx in enumerate(self.contexts):
            first = 0 if ratio > 1 else max(0, ctx - self.reach) // self.block
            last = (ctx + extra - 1) // self.block
            n = last + 1 - first
            table[r, first:last + 1] = np.arange(next_id, next_id + n)
            next_id += n
        return torch.from_numpy(table)

    def forward(self, new_tokens: list[list[int]]) -> tuple[torch.Tensor, float]:
        """One step: request r appends new_tokens[r] after its current length -> (logits of
        every new token [T, vocab], seconds)."""
        qlens = np.array([len(t) for t in new_tokens], dtype=np.int64)
        start = np.array(self.lengths, dtype=np.int64)
        seq = start + qlens
        pos = torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in zip(start, seq)]))
        rows = torch.from_numpy(np.repeat(np.arange(len(seq)), qlens))
        views = []
        for spec, table in zip(self.groups, self.tables):
            view = KVGroupView(self.block, spec.compress_ratio, table)
            if spec.compress_ratio == 1:
                view.slot_mapping = view.entry_slots(rows, pos)
            views.append(view)
        qsl = np.concatenate([[0], np.cumsum(qlens)])
        batch = ForwardBatch(input_ids=torch.tensor([t for ts in new_tokens for t in ts]),
                             positions=pos, query_start_loc=torch.from_numpy(qsl),
                             seq_lens=torch.from_numpy(seq), query_start_loc_cpu=qsl,
                             seq_lens_cpu=seq, kv_caches=self.caches, kv_groups=views,
                             cache_group=self.cache_group)
        t = time.perf_counter()
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model.forward(batch))
        dt = time.perf_counter() - t
        self.lengths = seq.tolist()
        return logits, dt

    def decode(self) -> float:
        """One decode step, one token per request -> seconds."""
        return self.forward([[7]] * len(self.lengths))[1]


def measure(model, names: list[str], paths: list[str], steps: int, block: int,
            interleave: bool) -> list[dict]:
    """Median and fastest decode step per (scenario, indexer path). Interleaved: every
    scenario's batch stays alive and each step round-robins over all (scenario, path) pairs,
    so a load change on a shared machine hits every pair alike."""
    pairs = [(n, p) for n in names for p in paths]
    times: dict[tuple[str, str], list[float]] = {pair: [] for pair in pairs}
    if interleave:
        batches = {n: Batch(model, SCENARIOS[n], block) for n in names}
        for i in range(steps + 2):
            for name, path in pairs:
                set_indexer_path(model, path == "fused")
                dt = batches[name].decode()
                if i >= 2:
                    times[name, path].append(dt)
    else:
        for name, path in pairs:
            set_indexer_path(model, path == "fused")
            batch = Batch(model, SCENARIOS[name], block)
            times[name, path] = [batch.decode() for _ in range(steps + 2)][2:]
            del batch
    rows = [{"scenario": n, "indexer": p, "contexts": SCENARIOS[n],
             "ms": 1000 * float(np.median(times[n, p])),
             "min_ms": 1000 * float(np.min(times[n, p]))} for n, p in pairs]
    for row in rows:
        print(row, flush=True)
    for path in paths:
        by = {r["scenario"]: r for r in rows if r["indexer"] == path}
        if "short" in by and "long" in by:
            print(f"{path}: long / short = {by['long']['ms'] / by['short']['ms']:.3f} "
                  f"(best steps {by['long']['min_ms'] / by['short']['min_ms']:.3f})")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--attention-dtype", choices=["default", "fp32", "model"], default="default",
                    help="attention products (and indexer q.k) dtype: the defaults, all fp32, "
                         "or all in the model dtype")
    ap.add_argument("--indexer", nargs="+", choices=["fused", "torch"], default=["fused"],
                    help="CSA indexer scoring: the fused CPU op (default) and/or the torch loop")
    ap.add_argument("--interleave", action="store_true",
                    help="round-robin the steps of every (scenario, indexer) pair")
    ap.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS),
                    default=["short", "long", "mixed"])
    ap.add_argument("--tag", default="", help="label stored with the results (e.g. before)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "v4_decode_context.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = v4_model(DTYPES[args.dtype])
    if args.attention_dtype != "default":
        d = torch.float32 if args.attention_dtype == "fp32" else "model"
        set_precision(model, d, d)
    rows = measure(model, args.scenarios, args.indexer, args.steps, _v41_bench().BLOCK,
                   args.interleave)
    record = {"tag": args.tag, "dtype": args.dtype, "attention_dtype": args.attention_dtype,
              "interleave": args.interleave, "machine": machine_info(), "rows": rows,
              "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                   time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
