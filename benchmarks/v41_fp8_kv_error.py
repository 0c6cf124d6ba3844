"""How far DeepSeek-V4.1's logits with packed FP8 / NVFP4 / MXFP4 KV records sit from the
reference's (nemo-automodel, fp32) on the tiny test configs, over many random models and
prompts (docs/deepseek_v41.md, "KV records"): the distribution of max |dlogit| per run, and
how often a run moves by more than the 1e-2 a single neighbouring-bin record gives.

  PYTHONPATH=.:tests:tests/models python benchmarks/v41_fp8_kv_error.py [--seeds 8]

Both sides quantise the same values to within fp32 last bits; a value on a rounding boundary
lands in the neighbouring bin on one side. Usually that moves later logits by <= ~1e-2, but
when the moved value feeds a discrete decision (an MoE router's top-k, an indexer's top-k)
that sits near its own tie, the decision flips and the logits move by O(1)."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import v41_helpers as h
from paged_harness import PagedHarness


def run(name: str, seed: int, tmp: Path) -> float:
    kw = h.CONFIGS[name]
    m = h.oracle_model(kw, seed=seed)
    ws = h.ws_model(h.save_checkpoint(m, kw, tmp / f"{name}_{seed}"))
    seqs = [h.random_tokens(n, seed=100 * seed + i) for i, n in enumerate((41, 30))]
    ref = torch.cat([h.oracle_logits(m, s) for s in seqs])
    harness = PagedHarness(ws, max_reqs=2, max_len=max(map(len, seqs)) + 4,
                           specs=ws.kv_cache_specs("auto"))
    return (harness.step([0, 1], seqs) - ref).abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--configs", nargs="+", default=sorted(h.CONFIGS))
    a = p.parse_args()
    torch.set_num_threads(1)
    errs = []
    with tempfile.TemporaryDirectory() as d:
        for name in a.configs:
            for seed in range(a.seeds):
                e = run(name, seed, Path(d))
                errs.append(e)
                print(f"config {name} seed {seed}: max |dlogit| {e:.3g}", flush=True)
    errs.sort()
    n = len(errs)
    print(f"{n} runs: median {errs[n // 2]:.3g}, p90 {errs[int(0.9 * (n - 1))]:.3g}, "
          f"max {errs[-1]:.3g}; > 1e-4: {sum(e > 1e-4 for e in errs)}, > 1e-2: "
          f"{sum(e > 1e-2 for e in errs)}, > 0.1: {sum(e > 0.1 for e in errs)}")


if __name__ == "__main__":
    main()
