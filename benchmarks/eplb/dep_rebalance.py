"""DEP4 with EPLB on the bundled model's real routing: step time and per-rank expert time
before and after a rebalance, the rebalance's duration and its cost per step while it runs.

Three identical waves of greedy requests (held-out Shakespeare prompts, prefix caching off,
every request the same length, so each wave is exactly `--max-tokens` lock-step iterations).
EPLB's window and interval equal one wave: the plan is made from wave 1's routing on its last
step and the weights move during wave 2's first steps (`layers_per_step` layers a step);
wave 3 runs on the new placement. Per wave: wall time, and from every rank's stats the time
spent in the experts (`expert_s`: rows received through the all-to-all, i.e. the load the
placement gave it) and in the all-to-all itself; balancedness as EPLB measured it.

    python benchmarks/eplb/dep_rebalance.py [--dp 4] [--redundant 4]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests/parallel"))

from dist_utils import free_port_block  # noqa: E402
from wideserve import LLM, SamplingParams  # noqa: E402


def per_rank(stats: dict, key: str, sub: str = "dp") -> list[float]:
    return [float(r[sub][key]) for r in stats["per_rank"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--layers-per-step", type=int, default=1)
    ap.add_argument("--no-rebalance", action="store_true",
                    help="control run: EPLB records but never rebalances")
    ap.add_argument("--out", default="benchmarks/results/eplb_dep_rebalance.json")
    args = ap.parse_args()
    from tiny_data import held_out_stream  # noqa: PLC0415
    from wideserve.worker.model_loader import BUNDLED_MODEL  # noqa: PLC0415
    stream = held_out_stream(str(BUNDLED_MODEL))
    n, plen = args.num_prompts, args.prompt_len
    prompts = [{"prompt_token_ids": stream[i * plen:(i + 1) * plen].tolist()} for i in range(n)]
    interval = 10**9 if args.no_rebalance else args.max_tokens
    eplb = {"window_size": args.max_tokens, "step_interval": interval,
            "num_redundant_experts": args.redundant, "layers_per_step": args.layers_per_step,
            # Balancedness refreshed every step, so each wave's number covers that wave.
            "log_balancedness": True, "log_balancedness_interval": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(None, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False,
                  max_num_batched_tokens=n * plen, max_num_seqs=n, kv_cache_memory=1 << 26,
                  data_parallel_size=args.dp, enable_expert_parallel=True, enable_eplb=True,
                  eplb_config=eplb, data_parallel_rpc_port=free_port_block(2 + 2 * args.dp),
                  dp_sync_timeout_s=120)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    waves = []
    try:
        before = llm.engine.get_stats()
        for wave in range(3):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            time.sleep(0.5)                      # let every rank finish the last iteration
            after = llm.engine.get_stats()
            expert = [b - a for a, b in zip(per_rank(before, "expert_s"),
                                            per_rank(after, "expert_s"))]
            a2a = [b - a for a, b in zip(per_rank(before, "a2a_s"), per_rank(after, "a2a_s"))]
            target = after["per_rank"][0]["eplb"]["target"]
            waves.append({"wave": wave + 1, "wall_s": wall,
                          "step_ms": 1e3 * wall / args.max_tokens,
                          "expert_s_per_rank": expert,
                          "expert_max_over_mean": max(expert) / (sum(expert) / len(expert)),
                          "a2a_s_per_rank": a2a, "eplb_target": target,
                          "eplb_draft": after["per_rank"][0]["eplb"].get("draft"),
                          "tokens": sum(len(o.outputs[0].token_ids) for o in outs)})
            w = waves[-1]
            print(f"wave {wave + 1}: {w['wall_s']:.2f} s ({w['step_ms']:.1f} ms/step), expert "
                  f"time per rank {[round(x, 3) for x in expert]} (max/mean "
                  f"{w['expert_max_over_mean']:.2f}), balancedness "
                  f"{target['balancedness']:.3f}, rebalances {target['rebalances']}, "
                  f"last {target['last_rebalance_s'] * 1e3:.1f} ms over "
                  f"{target['last_rebalance_steps']} steps (plan {target['last_plan_s'] * 1e3:.1f}"
                  f" ms, worst step {target['max_move_step_s'] * 1e3:.1f} ms moving)", flush=True)
            before = after
    finally:
        llm.shutdown()
    describe = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": {"git": describe, "args": vars(args),
                                                   "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                         time.gmtime())},
                                          "waves": waves}, indent=1) + "\n")


if __name__ == "__main__":
    main()
