"""Balancedness of the bundled model's real routing, before and after EPLB (target and draft).

The bundled tiny DeepSeek-V4 (4 MoE layers, 8 experts, top-2, one MTP block) runs greedy
generation with MTP speculation on held-out Shakespeare through the engine with EPLB on; the
loads are the engine's own recorded windows (target: the 4 decoder layers, draft: the MTP
block's MoE). Two windows of different prompts: the plan is computed from window A and scored
on window A (in-sample) and on window B (held-out), for EP2/EP4, with 0 and 4 redundant
experts, against the identity (contiguous) placement and, with --reference-eplb, deepseek-ai's
algorithm planned from the same window.

    python benchmarks/eplb/bundled_routing.py [--reference-eplb /path/to/eplb.py]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from wideserve.parallel.eplb import policy  # noqa: E402
from wideserve.serving.llm import LLM  # noqa: E402
from wideserve.types.sampling_params import SamplingParams  # noqa: E402


def windows(num_prompts: int, prompt_len: int, max_tokens: int) -> dict[str, list[np.ndarray]]:
    from tiny_data import held_out_stream  # noqa: PLC0415
    from wideserve.worker.model_loader import BUNDLED_MODEL  # noqa: PLC0415
    stream = held_out_stream(str(BUNDLED_MODEL))
    llm = LLM(enable_eplb=True, eplb_config={"window_size": 100000, "step_interval": 10**9},
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, list[np.ndarray]] = {"target": [], "draft": []}
    for w in range(2):
        base = w * num_prompts * prompt_len
        prompts = [{"prompt_token_ids": stream[base + i * prompt_len:
                                               base + (i + 1) * prompt_len].tolist()}
                   for i in range(num_prompts)]
        llm.generate(prompts, sp, use_tqdm=False)
        for role, b in llm.engine.eplb.balancers.items():
            out[role].append(b.recorder.window_sum.cpu().numpy().copy())
            b.recorder.window_sum.zero_()
            b.recorder.ring.zero_()
    return out


def score(load: np.ndarray, phy2log: torch.Tensor, ranks: int) -> float:
    return policy.balancedness(policy.rank_loads(torch.from_numpy(load), phy2log, ranks))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference-eplb", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/eplb_bundled.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ref = None
    if args.reference_eplb:
        sys.path.insert(0, str(ROOT / "benchmarks/eplb"))
        from reference_compare import load_reference  # noqa: PLC0415
        ref = load_reference(args.reference_eplb)
    loads = windows(args.num_prompts, args.prompt_len, args.max_tokens)
    rows = []
    for role, (a, b) in loads.items():
        layers, experts = a.shape
        skew = (a.max(1) / a.mean(1)).round(2).tolist()
        print(f"{role}: {layers} layer(s), tokens routed per window {int(a.sum())} / "
              f"{int(b.sum())}, per-layer max/mean expert load {skew}")
        for ranks in (2, 4):
            for red in (0, 4):
                slots = experts + red
                if slots % ranks:
                    continue
                ident = policy.identity_placement(layers, experts, slots)
                ours = policy.rebalance(torch.from_numpy(a), slots, ranks)
                row = {"role": role, "ranks": ranks, "redundant": red,
                       "identity": score(b, ident, ranks), "ours": score(a, ours, ranks),
                       "ours_held_out": score(b, ours, ranks), "max_over_mean": skew}
                if ref is not None:
                    p = ref(torch.from_numpy(a).float(), slots, 1, 1, ranks)[0].long()
                    row["reference"], row["reference_held_out"] = score(a, p, ranks), \
                        score(b, p, ranks)
                rows.append(row)
                print(f"  EP{ranks} red={red}: identity {row['identity']:.3f} -> ours "
                      f"{row['ours']:.3f} in-sample / {row['ours_held_out']:.3f} held-out"
                      + (f"; reference {row['reference']:.3f} / "
                         f"{row['reference_held_out']:.3f}" if ref else ""))
    describe = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "meta": {"git": describe, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "args": vars(args)},
        "loads": {k: [w.tolist() for w in v] for k, v in loads.items()}, "rows": rows},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
