"""In-process A/B of the persistent decode batch (worker/decode_batch.py; BENCHMARKS.md "Host
path at batch 64: the persistent decode batch") on the offline workload of offline_worker.py.

One LLM; each round runs the timed generate once with the path off (`runner.decode = None`:
every decode step builds its batch and plans the layers) and once with it on, alternating, so
both see the same load. Prints out tok/s by wall time and by CPU time of this process (per
round as it runs, then median and best as one JSON line), and checks the greedy tokens of
both variants are equal.

  PYTHONPATH=. python benchmarks/vs_vllm/decode_batch_ab.py MODEL --threads 1 --rounds 8

MODEL: e.g. MODELS_DIR/qwen3moe-11m from make_models.py. The first round is a warm-up for
both variants (it misses the prefix cache that the later rounds hit) and is not counted.
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
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    from wideserve.serving.llm import LLM
    from wideserve.types.sampling_params import SamplingParams
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 8192) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    llm = LLM(args.model, dtype="bfloat16", max_model_len=1024, threads=args.threads)
    runner = llm.engine.runner
    kept = runner.decode
    assert kept is not None, "the persistent decode batch is off in this engine"
    variants = {"off": None, "on": kept}
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rates: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in variants}
    tokens: dict[str, list] = {}
    for rnd in range(args.rounds + 1):
        for name, path in variants.items():
            runner.decode = path
            t, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
            if rnd == 0:
                continue
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name][0].append(n / wall)
            rates[name][1].append(n / cpu)
            print(f"# round {rnd} {name}: {n / wall:.0f} tok/s wall, {n / cpu:.0f} tok/s CPU, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            got = [o.outputs[0].token_ids for o in outs]
            assert tokens.setdefault(name, got) == got, f"{name}: tokens changed across rounds"
    assert tokens["on"] == tokens["off"], "greedy tokens differ between the variants"
    result = {"threads": args.threads, "load": os.getloadavg(), "rounds": args.rounds}
    for name, (wall, cpu) in rates.items():
        result[name] = {"wall_tok_s_median": round(statistics.median(wall)),
                        "wall_tok_s_best": round(max(wall)),
                        "cpu_tok_s_median": round(statistics.median(cpu)),
                        "cpu_tok_s_best": round(max(cpu))}
    on, off = result["on"], result["off"]
    result["ratio_on_off"] = {k: round(on[k] / off[k], 3) for k in on}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
