"""In-process A/B of the fused experts op's schedules in the engine (csrc/moe_by_expert.h;
BENCHMARKS.md, "Zen 4: the decode experts by whole experts") on the offline workload of
offline_worker.py.

One LLM; each round runs the timed generate once with every MoE layer's fused op on the
column schedule and once with the op's own choice (whole experts where it pays), in random
order, so both see the same host. Prints out tok/s by wall time per round, then the medians
and the median of the paired ratios as one JSON line, and checks the greedy tokens of both
are equal.

  PYTHONPATH=. python benchmarks/vs_vllm/experts_schedule_ab.py MODEL --threads 2 --rounds 6

MODEL: e.g. MODELS_DIR/qwen3moe-653m from make_models.py. Round 0 is a warm-up, not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    from wideserve.layers.experts import RoutedExperts
    from wideserve.serving.llm import LLM
    from wideserve.types.sampling_params import SamplingParams
    schedule: dict[str, str | None] = {"now": None}
    fused_op = RoutedExperts.fused_op

    def scheduled(self, device, dtype):   # the engine's fused op, with the round's schedule
        op = fused_op(self, device, dtype)
        if op is None or self._coded_runs(dtype):
            return op
        w13, w2, inter = self._fused_pack()
        big, table, load = self._packs.brgemm_min_rows, self.logical_to_physical, self.expert_load
        return lambda x, ids, w: torch.ops.wideserve.moe_fused_experts(
            x, ids, w, w13, w2, inter, self.swiglu_limit, False, table, load, big,
            schedule["now"])

    RoutedExperts.fused_op = scheduled
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 8192) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    llm = LLM(args.model, dtype="bfloat16", max_model_len=1024, threads=args.threads)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    sides = {"columns": "columns", "auto": None}
    rates: dict[str, list[float]] = {k: [] for k in sides}
    ratios, tokens = [], {}
    for rnd in range(args.rounds + 1):
        got = {}
        for name in rng.sample(list(sides), 2):
            schedule["now"] = sides[name]
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            got[name] = len(outs) * args.output_len / (time.perf_counter() - t)
            ids = [o.outputs[0].token_ids for o in outs]
            assert tokens.setdefault(name, ids) == ids, f"{name}: tokens changed across rounds"
        if rnd == 0:
            continue
        for name, rate in got.items():
            rates[name].append(rate)
        ratios.append(got["auto"] / got["columns"])
        print(f"# round {rnd}: columns {got['columns']:.0f}, auto {got['auto']:.0f} out tok/s, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    assert tokens["auto"] == tokens["columns"], "greedy tokens differ between the schedules"
    print(json.dumps({"threads": args.threads, "rounds": args.rounds,
                      **{f"{k}_tok_s_median": round(statistics.median(v))
                         for k, v in rates.items()},
                      "auto_over_columns_paired_median": round(statistics.median(ratios), 3)}))


if __name__ == "__main__":
    main()
