"""LLM()'s thread governor (wideserve/utils/thread_governor.py) as the machine's load moves:
one engine per configuration generates in phases - idle, beside a process that keeps one CPU
busy (started at the phase's start, stopped at its end), idle again - and prints the output
tokens/s of each generate call and the thread count after it. BENCHMARKS.md, "Zen 5: the
spare core lent while idle".

  PYTHONPATH=. python benchmarks/thread_governor_phases.py MODEL [--configs default,1,2]
      [--calls 4] [--prompts 64] [--output-len 64]

Each configuration runs in a child process (OMP_NUM_THREADS removed, so "default" is what a
user gets); the configurations alternate over `--rounds`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, subprocess, sys, time
import torch
from wideserve import LLM, SamplingParams
model, config, calls, prompts, out_len = sys.argv[1:6]
llm = LLM(model, skip_tokenizer_init=True,
          threads=None if config == "default" else int(config))
sp = SamplingParams(temperature=0.0, max_tokens=int(out_len), ignore_eos=True)
batch = [{"prompt_token_ids": [(7 * i + j) % 4000 + 10 for j in range(128)]}
         for i in range(int(prompts))]
llm.generate(batch[:4], SamplingParams(max_tokens=4), use_tqdm=False)     # warm-up
rows = []
for phase in ("idle", "busy", "idle"):
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) \
        if phase == "busy" else None
    try:
        for _ in range(int(calls)):
            t = time.perf_counter()
            outs = llm.generate(batch, sp, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append([phase, torch.get_num_threads(),
                         round(tokens / (time.perf_counter() - t), 1)])
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
print(json.dumps(rows))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--configs", default="default,1,2")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--calls", type=int, default=4, help="generate calls per phase")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO)
    print(f"cpus {sorted(os.sched_getaffinity(0))}, load {os.getloadavg()[0]:.1f}")
    for rnd in range(args.rounds):
        for config in args.configs.split(","):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, args.model, config, str(args.calls),
                 str(args.prompts), str(args.output_len)],
                env=env, check=True, capture_output=True, text=True).stdout
            rows = json.loads(out.strip().splitlines()[-1])
            print(f"round {rnd} threads={config}: " + "  ".join(
                f"{phase} {rate:,.0f} ({threads}t)" for phase, threads, rate in rows),
                flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
