"""Single-user decode speed: the small-batch decode path against the standard path
(docs/host_path.md, "The small-batch decode path").

One engine per model; requests run one at a time (a single user; `--batch N` runs N at once)
and alternate between the two paths on the same engine, weights and KV cache (the path is
switched by setting `runner.small`, what LoadConfig.small_batch_decode=0 leaves None; the
DeepSeek models' linears, swapped to SmallMLinear at start-up, are then plain F.linear, as
with the path off), the order flipped every round so drift in the machine's load falls on
both. Per request: decode
tokens/s = (output tokens - 1) / (time from the first to the last token). Reported per path:
the mean over requests and the P90 figure, 1 / (90th percentile time per output token): the
speed 90% of requests reach. Greedy outputs of the two paths are compared too.

  PYTHONPATH=. python benchmarks/small_batch.py [--models v4,v41,qwen3moe,11m] [--rounds 8]
        [--tokens 64] [--batch 1] [--model-11m PATH] [--threads 1] [--gemms on|off]
        [--clock wall|cpu] [--standard persistent|plain]

Models: v4 / v41 the bundled tiny checkpoints, qwen3moe the tiny random config of
tests/tiny_families.py (dummy weights), 11m the random Qwen3-MoE 11M checkpoint that
`python benchmarks/vs_vllm/make_models.py DIR` writes (`--models ...,11m --model-11m
DIR/qwen3moe-11m`). All in bf16 (the CPU's serving dtype).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from tiny_families import model_dir, vocab_size  # noqa: E402
from wideserve import LLM, SamplingParams  # noqa: E402
from wideserve.types.messages import EngineCoreRequest  # noqa: E402


def _load(name: str, tmp: Path, path_11m: str, gemms: bool, persistent: bool
          ) -> tuple[LLM, int]:
    dummy = name == "qwen3moe"
    path = Path(path_11m) if name == "11m" else model_dir(name, tmp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(str(path), dtype="bfloat16", load_format="dummy" if dummy else "auto",
                  max_model_len=512, kv_cache_memory=1 << 28, max_num_seqs=16,
                  skip_tokenizer_init=True, small_batch_gemms=gemms,
                  persistent_decode_batch=persistent,
                  threads=torch.get_num_threads())   # main()'s --threads
    return llm, vocab_size(path)


def _run(llm: LLM, prompts: list[list[int]], tokens: int, tag: str, clock=time.perf_counter
         ) -> tuple[list[float], list[list[int]]]:
    """The prompts at once; per request its decode seconds per token (on `clock`), and its
    tokens."""
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    got: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        engine.add_request(EngineCoreRequest(rid, p, sp))
        got[rid] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = clock()
        for out in outs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                got[out.request_id] += out.new_token_ids
    tpot = [(last[r] - first[r]) / (len(got[r]) - 1) for r in got]
    return tpot, list(got.values())


def bench_model(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    llm, vocab = _load(name, tmp, args.model_11m, args.gemms == "on",
                       args.standard == "persistent")
    runner = llm.engine.runner
    small = runner.small
    if small is None:
        raise SystemExit(f"{name}: the small-batch path is off for this engine")
    gen = np.random.default_rng(0)
    # this thread's CPU time: on a loaded machine, what the step cost without the waits for
    # a core (one torch thread: the step's ops run on this thread)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    tpot: dict[str, list[float]] = {"small": [], "standard": []}
    same = True
    # First-use costs, on both paths and at the measured lengths: oneDNN builds a primitive
    # for every new shape (~1 ms for a bf16 bmm: V4's attention products, whose key count
    # grows each step), kept in its cache afterwards; unwarmed, round 0's first path paid them.
    warm = [gen.integers(2, vocab, args.prompt).tolist()] * args.batch
    for path in ("small", "standard"):
        runner.small = small if path == "small" else None
        _run(llm, warm, args.tokens, f"warm-{path}", clock)
    for rnd in range(args.rounds):
        prompts = [gen.integers(2, vocab, args.prompt).tolist() for _ in range(args.batch)]
        order = ("small", "standard") if rnd % 2 == 0 else ("standard", "small")
        outs = {}
        for path in order:
            runner.small = small if path == "small" else None
            t, outs[path] = _run(llm, prompts, args.tokens, f"{path}{rnd}", clock)
            tpot[path] += t
        same &= outs["small"] == outs["standard"]
    runner.small = small

    def summary(ts: list[float]) -> dict:
        return {"mean": statistics.fmean(1 / t for t in ts),
                "p90": 1 / float(np.percentile(ts, 90))}
    res = {p: summary(ts) for p, ts in tpot.items()}
    res["same"] = same
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="v4,v41,qwen3moe")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model-11m", default=None,
                    help="the 11M checkpoint (benchmarks/vs_vllm/make_models.py); needed by 11m")
    ap.add_argument("--gemms", choices=("on", "off"), default="on",
                    help="LoadConfig.small_batch_gemms (small-M GEMMs for DeepSeek's linears)")
    ap.add_argument("--standard", choices=("persistent", "plain"), default="persistent",
                    help="the standard path's decode batch: kept across steps (the engine's "
                         "default, LoadConfig.persistent_decode_batch) or rebuilt each step")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU time (a loaded machine; needs --threads 1)")
    args = ap.parse_args()
    if "11m" in args.models.split(",") and not args.model_11m:
        ap.error("--models 11m needs --model-11m PATH (benchmarks/vs_vllm/make_models.py "
                 "writes the checkpoint)")
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu measures this thread alone: use it with --threads 1")
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, {args.rounds} rounds x {args.tokens} tokens per path, "
          f"{args.threads} thread(s), small-M GEMMs {args.gemms}, {args.clock} clock, "
          f"{args.standard} standard decode batch")
    print("| model | standard mean / P90 tok/s | small-batch mean / P90 tok/s | "
          "mean ratio | P90 ratio | greedy equal |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            r = bench_model(name, args, Path(tmp))
            s, b = r["standard"], r["small"]
            print(f"| {name} | {s['mean']:.1f} / {s['p90']:.1f} | {b['mean']:.1f} / "
                  f"{b['p90']:.1f} | {b['mean'] / s['mean']:.2f}x | "
                  f"{b['p90'] / s['p90']:.2f}x | {r['same']} |", flush=True)


if __name__ == "__main__":
    main()
