"""The captured decode step on a GPU: capture, replay, greedy tokens against --enforce-eager,
step times (docs/cuda_graphs.md). Prepared where no GPU was lent; run it where one is.

A tiny random Qwen3-MoE (dummy weights from a config.json, no download, no tokenizer) runs
greedy generation at several batch sizes, three ways:
  guard   the eager engine with every decode size run through GuardedCapturer on the device:
          the capture guard over the real device paths (no sync, no host-built tensor, no
          CPU-only op, each replay the trace of its capture). CUDA only: on the CPU the
          default paths are the C++ ops, which the guard rejects by design (the CPU tests
          force the CUDA paths instead, tests/cuda_paths.py).
  eager   --enforce-eager (no compile, no captured step);
  graphs  the default: on CUDA the compiled forward with the decode step captured as CUDA
          graphs at startup (the run fails unless graphs were captured); on the CPU the
          captured step with eager replays (decode_capture=True), which exercises the flow.
Every run's greedy tokens must equal the eager run's. One JSON line per run and batch size:
wall seconds, output tokens/s, mean forward/sample ms per engine step (StepTimer synchronises
the device before each clock read), steps. Exit status 1 on a mismatch or a failed check.

  PYTHONPATH=. python benchmarks/cuda_graph_check.py                       # a CUDA machine
  PYTHONPATH=. python benchmarks/cuda_graph_check.py --device cpu --batches 1,3 --max-tokens 8
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

MODEL = dict(   # small, with widths torch._grouped_mm accepts in bf16 (row strides of 16 bytes)
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=1024,
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=16,
    num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096,
    rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, eos_token_id=1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,3,8,16", help="batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 28)
    p.add_argument("--runs", default="guard,eager,graphs")
    return p.parse_args(argv)


def write_model(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(MODEL))
    return root


def make_llm(path: Path, args: argparse.Namespace, run: str):
    from wideserve import LLM
    kw = dict(device=args.device, dtype=args.dtype, load_format="dummy", block_size=16,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_memory, skip_tokenizer_init=True)
    if run in ("eager", "guard"):
        kw["enforce_eager"] = True
    elif args.device == "cpu":
        kw["decode_capture"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(str(path), **kw)
    if run == "guard":
        from wideserve.worker.capture_guard import GuardedCapturer
        from wideserve.worker.decode_capture import capture_sizes
        llm.engine.runner.enable_decode_capture(capture_sizes(args.max_num_seqs),
                                            args.max_model_len, capturer=GuardedCapturer())
    return llm


def check_setup(llm, run: str, device: torch.device) -> str | None:
    """Why this run is not what it claims to be (None: it is)."""
    from wideserve.worker.capture_guard import GuardedCapturer
    from wideserve.worker.decode_capture import CudaGraphCapturer, capturable
    captured = llm.engine.runner.captured
    if run == "eager":
        return None if captured is None else "--enforce-eager left a captured step on"
    if captured is None:
        return "no captured decode step"
    if run == "guard":
        return None if isinstance(captured.capturer, GuardedCapturer) else "no guard"
    if device.type == "cuda":
        if not capturable(llm.engine.model, device):
            return "the model does not declare its decode forward capturable on CUDA"
        if not isinstance(captured.capturer, CudaGraphCapturer):
            return f"decode replays with {type(captured.capturer).__name__}, not CUDA graphs"
    return None


def prompts(batch: int, length: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(2, MODEL["vocab_size"], (length,),
                                               generator=g).tolist()} for _ in range(batch)]


def generate(llm, batch: int, args: argparse.Namespace) -> tuple[list[list[int]], dict]:
    from wideserve import SamplingParams
    stats = llm.engine.timer.stats
    steps0, secs0 = stats.steps, dict(stats.seconds)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts(batch, args.prompt_len, seed=batch), params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = stats.steps - steps0
    per_step = {k: round(1e3 * (stats.seconds[k] - secs0[k]) / max(steps, 1), 3)
                for k in ("forward", "sample")}
    tokens = [o.outputs[0].token_ids for o in outs]
    return tokens, dict(wall_s=round(wall, 3), out_tok_s=round(batch * args.max_tokens / wall, 1),
                        steps=steps, **{f"{k}_ms_per_step": v for k, v in per_step.items()})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu for the CPU flow", file=sys.stderr)
        return 1
    runs = args.runs.split(",")
    if device.type != "cuda" and "guard" in runs:
        runs.remove("guard")      # the CPU's C++ ops fail the guard by design (see above)
    batches = [int(b) for b in args.batches.split(",")]
    tokens: dict[str, dict[int, list[list[int]]]] = {}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp) / "qwen3moe-tiny")
        for run in ["eager"] + [r for r in runs if r != "eager"]:
            t0 = time.perf_counter()
            llm = make_llm(path, args, run)
            startup = time.perf_counter() - t0
            problem = check_setup(llm, run, device)
            captured = llm.engine.runner.captured
            print(json.dumps(dict(run=run, startup_s=round(startup, 2), ok=problem is None,
                                  problem=problem,
                                  replays_made=0 if captured is None else captured.num_replays,
                                  context_buckets=None if captured is None else
                                  list(captured.buckets))), flush=True)
            if problem is not None:
                failed = True
                continue
            tokens[run] = {}
            for b in batches:
                tokens[run][b], row = generate(llm, b, args)
                same = tokens[run][b] == tokens["eager"].get(b)
                failed |= not same
                print(json.dumps(dict(run=run, batch=b, greedy_equal_to_eager=same, **row)),
                      flush=True)
            del llm
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps(dict(result="FAIL" if failed else "OK")), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
