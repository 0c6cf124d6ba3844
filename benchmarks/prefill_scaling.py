"""Which op of a prefill does not scale with threads: compare.sh's prefill row (the 653M model,
16 prompts x 1,024 tokens -> 1) under the torch profiler at each thread count, one process per
count, and per op its time, its share and its speed-up over the first count.

  PYTHONPATH=. python benchmarks/prefill_scaling.py MODEL [--threads 1 2] [--rounds 2]
      [--max-num-batched-tokens N] [--out FILE.jsonl]

Each process times `--rounds` prefill calls without the profiler (prompt tok/s; fresh
prompts each call, so that no call hits the prefix cache) and one more under it (self CPU
time per op: the work an op does on the calling thread, its parallel region included; ops the
profiler does not see are "(outside ops)", the wall time less the ops' sum). An op whose
speed-up falls short of the thread ratio while the others reach it is where the cores wait
(a serial part, memory traffic two cores share); the table says which share of the call it
is. BENCHMARKS.md, "Zen 5: the prefill row's warm-up, its ops per thread count, the token
budget (session 38, issue 24)".
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The dense GEMMs run whichever kernel the machine's table chose for the shape and the thread
# count (wideserve/kernels/choice.py): one row for them all, so that a count that picks
# another kernel still compares like with like.
LINEAR_OPS = ("mkldnn::_linear_pointwise", "wideserve::gemm_linear", "aten::addmm", "aten::mm",
              "aten::linear")
LINEARS = "linears (the chosen kernels)"


def _grouped(ops: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, ms in ops.items():
        key = LINEARS if name.startswith(LINEAR_OPS) else name
        out[key] = out.get(key, 0.0) + ms
    return out


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    """Token-id prompts as offline_worker.py draws them; each call its own seed, so that no
    call finds another's blocks in the prefix cache."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]}
            for _ in range(n)]


def worker(args: argparse.Namespace) -> dict:
    """One thread count in this process: the throughput rounds, then the profiled call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from wideserve.serving.llm import LLM
    from wideserve.types.sampling_params import SamplingParams
    torch.set_num_threads(args.worker)
    extra = {} if args.max_num_batched_tokens is None else \
        {"max_num_batched_tokens": args.max_num_batched_tokens}
    # token-id prompts and one output token: no tokenizer needed (a bare checkpoint runs too)
    llm = LLM(args.model, dtype="bfloat16", max_model_len=args.input_len + 64,
              threads=args.worker, skip_tokenizer_init=True, **extra)
    vocab = llm.engine.vocab_size
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(_prompts(2, args.input_len, vocab, 0), sp, use_tqdm=False)     # warm-up
    tok_s = []
    for r in range(args.rounds):
        t = time.perf_counter()
        llm.generate(_prompts(args.num_prompts, args.input_len, vocab, r + 1), sp,
                     use_tqdm=False)
        tok_s.append(args.num_prompts * args.input_len / (time.perf_counter() - t))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        llm.generate(_prompts(args.num_prompts, args.input_len, vocab, args.rounds + 1), sp,
                     use_tqdm=False)
        wall_ms = (time.perf_counter() - t) * 1e3
    ops = _grouped({e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()})
    ops["(outside ops)"] = max(0.0, wall_ms - sum(ops.values()))
    return {"model": args.model, "threads": args.worker, "prompt_tok_s": tok_s,
            "profiled_wall_ms": wall_ms, "ops_ms": ops, "load": os.getloadavg()[0],
            "max_num_batched_tokens": llm.engine.scheduler_config.max_num_batched_tokens}


def table(runs: list[dict], top: int = 12) -> list[str]:
    """The ops that take the most time at the largest count, each count's ms and share, and
    the speed-up over the first count."""
    first, last = runs[0], runs[-1]
    ratio = last["threads"] / first["threads"]
    head = " | ".join(f"{r['threads']} thr ms (share)" for r in runs)
    lines = [f"| op | {head} | speed-up {first['threads']} -> {last['threads']} "
             f"(ideal {ratio:g}) |", "|---|" + "---|" * (len(runs) + 1)]
    names = sorted(last["ops_ms"], key=lambda k: -last["ops_ms"][k])[:top]
    for name in names:
        cells = []
        for r in runs:
            ms = r["ops_ms"].get(name, 0.0)
            cells.append(f"{ms:,.1f} ({ms / r['profiled_wall_ms']:.0%})")
        a, b = first["ops_ms"].get(name, 0.0), last["ops_ms"].get(name, 0.0)
        lines.append(f"| {name} | {' | '.join(cells)} | "
                     f"{f'{a / b:.2f}x' if a > 0 and b > 0 else '-'} |")
    walls = " | ".join(f"{r['profiled_wall_ms']:,.0f}" for r in runs)
    lines.append(f"| whole call | {walls} | "
                 f"{first['profiled_wall_ms'] / last['profiled_wall_ms']:.2f}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the engine's token budget per step (default: its own, 2048)")
    ap.add_argument("--out", default=None, help="append each count's JSON line here too")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args)))
        return
    runs = []
    for threads in args.threads:
        cmd = [sys.executable, __file__, args.model, "--worker", str(threads),
               "--rounds", str(args.rounds), "--num-prompts", str(args.num_prompts),
               "--input-len", str(args.input_len)]
        if args.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True)
        run = json.loads(done.stdout.strip().splitlines()[-1])
        runs.append(run)
        print(f"{threads} thread(s): prompt tok/s "
              f"{' / '.join(f'{v:,.0f}' for v in run['prompt_tok_s'])} (load {run['load']:.1f})")
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(run) + "\n")
    print("\n".join(table(runs)))


if __name__ == "__main__":
    main()
