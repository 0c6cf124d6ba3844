"""The prepared GPU check (docs/testing.md, "The prepared GPU check"): one run on a CUDA
machine answers what the CPU cannot. NOT YET RUN ON A GPU: every part that needs no CUDA is
tested on the CPU (tests/bench/test_gpu_check.py runs `--device cpu` end to end).

Per model family (tiny random configs, dummy weights, no download, no tokenizer):
  reference   greedy tokens on the CPU in fp32, eager;
  eager       the same prompts on --device with --enforce-eager: tokens against the reference,
              host syncs per step (torch.cuda.set_sync_debug_mode("warn"), each warning
              counted), decode step time at each batch size;
  graphs      the default path (captured decode step where the model has one): tokens against
              eager, capture path used or not, syncs and step times likewise.
Writes check.json and check.md under --out ($OUT if set, else benchmarks/gpu/results/).
Exit status 1 when a run fails or tokens differ.

  benchmarks/gpu/check.sh                                           # on a CUDA machine
  PYTHONPATH=. python benchmarks/gpu/check.py --device cpu --families qwen3moe --batches 1,2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QWEN3_MOE = dict(   # benchmarks/cuda_graph_check.py's: widths torch._grouped_mm accepts in bf16
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=1024,
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=16,
    num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096,
    rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, eos_token_id=1)
BUNDLED = {"v4": "shakespeare-v4-tiny", "v41": "shakespeare-v41-tiny"}
FAMILIES = ("v4", "v41", "qwen3moe")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run)")
    p.add_argument("--dtype", default="float32", help="device runs' dtype (reference: fp32)")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--batches", default="1,8,64", help="decode batch sizes to time")
    p.add_argument("--prompts", type=int, default=4, help="prompts of the greedy comparison")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks/gpu/results"))
    args = p.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        p.error(f"--families: unknown {unknown}; choose from {', '.join(FAMILIES)}")
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches: comma-separated integers, got {args.batches!r}")
    if not args.batches or min(args.batches) < 1:
        p.error("--batches: sizes must be >= 1")
    return args


def model_dir(family: str, tmp: Path) -> Path:
    if family in BUNDLED:
        return ROOT / "wideserve" / "assets" / BUNDLED[family]
    path = tmp / family
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(QWEN3_MOE))
    return path


@dataclass
class RunResult:
    family: str
    run: str                       # reference / eager / graphs
    device: str
    ok: bool = True
    error: str | None = None
    tokens_match: bool | None = None      # against the reference (eager) or eager (graphs)
    first_mismatch: int | None = None     # output position of the first differing token
    captured: bool | None = None          # a captured decode step was used
    syncs_per_step: float | None = None   # CUDA only
    step_ms: dict[int, float] = field(default_factory=dict)   # batch -> ms per decode step
    tokens: list[list[int]] = field(default_factory=list)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(2, vocab, (length,), generator=g).tolist()}
            for _ in range(n)]


def make_llm(path: Path, device: str, dtype: str, eager: bool, max_num_seqs: int):
    from wideserve import LLM
    kw = dict(device=device, dtype=dtype, load_format="dummy", max_num_seqs=max_num_seqs,
              max_model_len=256, kv_cache_memory=1 << 28, skip_tokenizer_init=True,
              enforce_eager=eager)
    if not eager and device == "cpu":
        kw["decode_capture"] = True          # the CPU's captured step: exercises the flow
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(str(path), **kw)


def greedy(llm, batch: list[dict], max_tokens: int) -> list[list[int]]:
    from wideserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]


def count_syncs(fn, device: str) -> tuple[object, int | None]:
    """fn() with CUDA's sync debug mode on warn; the number of synchronising calls."""
    if not device.startswith("cuda"):
        return fn(), None
    import torch
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchroniz" in str(w.message) for w in seen)


def step_ms(llm, vocab: int, args: argparse.Namespace, device: str) -> dict[int, float]:
    """Wall ms per decode step at each batch size: (two runs' time difference) / (extra
    tokens), so prefill cancels out; an untimed first run takes lazy compilation and
    capture at this batch size."""
    import torch
    out = {}
    for b in args.batches:
        batch = prompts(b, args.prompt_len, vocab, seed=b)
        greedy(llm, batch, 2 + args.max_tokens)              # warm-up, untimed
        times = []
        for n in (2, 2 + args.max_tokens):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            greedy(llm, batch, n)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[b] = round(1e3 * (times[1] - times[0]) / args.max_tokens, 3)
    return out


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> int | None:
    for x, y in zip(a, b):
        for i, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return i
        if len(x) != len(y):
            return min(len(x), len(y))
    return None if len(a) == len(b) else 0


def run_family(family: str, path: Path, args: argparse.Namespace) -> list[RunResult]:
    import torch
    vocab = json.loads((path / "config.json").read_text())
    vocab = (vocab.get("text_config") or vocab)["vocab_size"]
    batch = prompts(args.prompts, args.prompt_len, vocab)
    seqs = max(max(args.batches), args.prompts)
    results = []
    ref = RunResult(family, "reference", "cpu")
    try:
        llm = make_llm(path, "cpu", "float32", True, seqs)
        ref.tokens = greedy(llm, batch, args.max_tokens)
        del llm
    except Exception as e:  # noqa: BLE001 - reported, and the check fails
        ref.ok, ref.error = False, f"{type(e).__name__}: {e}"
        traceback.print_exc()
    results.append(ref)
    for run in ("eager", "graphs"):
        r = RunResult(family, run, args.device)
        try:
            llm = make_llm(path, args.device, args.dtype, run == "eager", seqs)
            r.captured = getattr(getattr(llm.engine, "runner", None), "captured", None) \
                is not None
            r.tokens, syncs = count_syncs(lambda: greedy(llm, batch, args.max_tokens),
                                          args.device)
            if syncs is not None:
                r.syncs_per_step = round(syncs / args.max_tokens, 2)
            against = ref.tokens if run == "eager" else results[-1].tokens
            r.first_mismatch = first_mismatch(r.tokens, against)
            r.tokens_match = r.first_mismatch is None
            r.step_ms = step_ms(llm, vocab, args, args.device)
            del llm
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            r.ok, r.error = False, f"{type(e).__name__}: {e}"
            traceback.print_exc()
        results.append(r)
    return results


def markdown(results: list[RunResult], batches: list[int], meta: dict) -> str:
    head = ["family", "run", "device", "ok", "tokens match", "captured", "syncs/step"] + \
        [f"ms/step b={b}" for b in batches]
    lines = [f"# GPU check: {meta['device_name']} ({meta['when']})", "",
             f"torch {meta['torch']}, dtype {meta['dtype']}, {meta['max_tokens']} greedy "
             "tokens; reference = CPU fp32 eager", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
    for r in results:
        match = fmt(r.tokens_match) if r.first_mismatch is None else \
            f"no (from token {r.first_mismatch})"
        row = [r.family, r.run, r.device, "yes" if r.ok else f"FAIL: {r.error}", match,
               fmt(r.captured), fmt(r.syncs_per_step)] + [fmt(r.step_ms.get(b)) for b in batches]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def write_report(results: list[RunResult], args: argparse.Namespace, meta: dict) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check.json").write_text(json.dumps(
        {"meta": meta, "results": [asdict(r) for r in results]}, indent=1))
    (out / "check.md").write_text(markdown(results, args.batches, meta))
    return out


def failed(results: list[RunResult]) -> bool:
    return any(not r.ok or r.tokens_match is False for r in results)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("no CUDA device here: --device cpu runs the dry run", file=sys.stderr)
            return 1
        torch.backends.cuda.matmul.allow_tf32 = False     # fp32 against the CPU's fp32
        torch.backends.cudnn.allow_tf32 = False
    meta = {"device": args.device, "dtype": args.dtype, "max_tokens": args.max_tokens,
            "torch": torch.__version__, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda")
            else "CPU dry run"}
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            results += run_family(family, model_dir(family, Path(tmp)), args)
    out = write_report(results, args, meta)
    print(markdown(results, args.batches, meta))
    print(f"written: {out / 'check.json'}, {out / 'check.md'}")
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
