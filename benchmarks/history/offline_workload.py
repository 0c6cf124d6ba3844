"""The vs_vllm offline workload for the in-process decode benchmarks (decode_replay.py,
lean_decode_ab.py): MODEL [--threads N] from the command line, the offline LLM in bf16, and
64 token-id prompts of 128 -> 128 tokens, greedy, EOS ignored."""
from __future__ import annotations

import argparse
import random
from typing import Any


def offline_workload(description: str) -> tuple[Any, list[dict], Any, int]:
    """(llm, prompts, sampling params, threads), torch's thread count already set."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    from wideserve.serving.llm import LLM
    from wideserve.types.sampling_params import SamplingParams

    llm = LLM(args.model, dtype="bfloat16", max_model_len=1024)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 8192) for _ in range(128)]}
               for _ in range(64)]
    return llm, prompts, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), \
        args.threads
