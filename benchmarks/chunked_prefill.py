"""Offline chunked prefill: N prompts x L token ids -> 1 token under a small token budget, so
every chunk after a prompt's first attends to a cached context (docs/cpu_kernels.md,
"Chunked and mixed prefills"). Prints one line: the generate call's CPU time (the calling
thread's: at one torch thread the whole engine step runs on it, and a shared machine's other
processes do not count) and wall time, and the first requests' greedy tokens (for checking
that two trees agree).

  PYTHONPATH=. python benchmarks/chunked_prefill.py MODEL [--prompts 4] [--len 1024]
      [--budget 256] [--tag NAME]

A/B two checkouts by running it from each in turn (alternating, the same arguments).
"""
from __future__ import annotations

import argparse
import os
import random
import time

from wideserve.serving.llm import LLM
from wideserve.types.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--len", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    llm = LLM(a.model, dtype="bfloat16", max_model_len=a.len + 16,
              max_num_batched_tokens=a.budget, enable_prefix_caching=False, threads=1)
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    warm = [{"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(2 * a.budget)]}]
    llm.generate(warm, sp, use_tqdm=False)              # first-call setup, kernel choice
    prompts = [{"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(a.len)]}
               for _ in range(a.prompts)]
    c0, t0 = time.thread_time(), time.perf_counter()
    out = llm.generate(prompts, sp, use_tqdm=False)
    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
    print(f"RESULT {a.tag} prompts {a.prompts}x{a.len} budget {a.budget}: cpu {cpu:.2f} s "
          f"wall {wall:.2f} s, {a.prompts * a.len / cpu:.0f} prompt tok/s (cpu), load "
          f"{os.getloadavg()[0]:.1f}, first tokens {[o.outputs[0].token_ids for o in out[:2]]}",
          flush=True)


if __name__ == "__main__":
    main()
