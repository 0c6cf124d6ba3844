"""`wideserve bench throughput [MODEL]`: run the offline benchmark from parsed arguments."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from wideserve.bench.report import command_line, machine_info
from wideserve.utils.extras import TRANSFORMERS

if TYPE_CHECKING:
    from wideserve.bench.datasets import BenchRequest


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=("random", "shared-prefix"), default="random",
                   help="random token prompts, or prompts sharing prefixes")
    g.add_argument("--num-prompts", type=int, default=32, help="requests")
    g.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens (shared-prefix: the distinct suffix after the prefix)")
    g.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="sample lengths uniformly in [L(1-r), L(1+r)] (random dataset)")
    g.add_argument("--prefix-len", type=int, default=768, help="shared-prefix: prefix tokens")
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes")
    g.add_argument("--ignore-eos", default=True, action=argparse.BooleanOptionalAction,
                   help="generate exactly --output-len tokens (default on)")
    g.add_argument("--dataset-seed", type=int, default=0, help="seed of the prompts")
    g = p.add_argument_group("run")
    g.add_argument("--backend", choices=("wideserve", "hf", "both"), default="wideserve",
                   help="hf/both also run transformers generate() on the same token ids")
    g.add_argument("--hf-batch-size", type=int, default=1,
                   help="transformers batch (left padding; refused for DeepSeek-V4)")
    g.add_argument("--repeats", type=int, default=1,
                   help="timed repeats (backends alternate); the median run is reported")
    g.add_argument("--prefix-window-mode", choices=("keep", "replay"), default="keep",
                   help="how a prefix hit restores sliding-window/compressor state")
    g.add_argument("--output-json", default=None, help="write the results here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _requests(args: argparse.Namespace, vocab_size: int, special: list[int]
              ) -> list[BenchRequest]:
    # numpy: imported when the benchmark runs, not when `wideserve bench --help` is built
    from wideserve.bench.datasets import random_requests, shared_prefix_requests, token_pool
    pool = token_pool(vocab_size, special)
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.input_len, args.output_len,
                               args.range_ratio, args.dataset_seed, pool=pool)
    return shared_prefix_requests(args.num_prompts, args.num_prefixes, args.prefix_len,
                                  args.input_len, args.output_len, args.dataset_seed, pool=pool)


def _special_ids(model_dir: Path, tokenizer: str | None) -> list[int]:
    from wideserve.text.tokenizer import Tokenizer
    try:
        return Tokenizer.from_pretrained(tokenizer or model_dir).all_special_ids
    except (FileNotFoundError, ValueError):
        return []


def _print_summary(results: dict[str, Any]) -> None:
    print(f"{'backend':<14}{'req/s':>9}{'in tok/s':>11}{'out tok/s':>11}{'total tok/s':>13}"
          f"{'elapsed s':>11}")
    for name, r in results["backends"].items():
        print(f"{name:<14}{r['requests_per_s']:>9.2f}{r['input_tokens_per_s']:>11.1f}"
              f"{r['output_tokens_per_s']:>11.1f}{r['total_tokens_per_s']:>13.1f}"
              f"{r['elapsed_s']:>11.2f}")
    if "ratio_output_tokens_per_s" in results:
        print(f"wideserve / transformers output tokens/s: "
              f"{results['ratio_output_tokens_per_s']:.2f}x; identical greedy outputs: "
              f"{results['identical_outputs']}/{results['num_requests']}")
        if results.get("divergence"):
            print(_divergence_line(results["divergence"], results["dtype"]))
    ws = results["backends"].get("wideserve")
    if ws:
        sb = ws["step_breakdown"]
        parts = ", ".join(f"{p} {ms:.2f}" for p, ms in sb["ms_per_step"].items())
        print(f"engine steps: {sb['steps']} ({sb['batched_tokens']} tokens); ms/step: {parts}; "
              f"outside steps {sb['outside_steps_s']:.2f} s")
        pc = ws["prefix_cache"]
        print(f"prefix cache: hits {pc['hits']}/{pc['queries']} ({100 * pc['hit_rate']:.1f}%), "
              f"prompt tokens computed {pc['prompt_tokens_computed']}; KV peak blocks in use "
              f"{ws['kv_blocks']['peak_blocks_in_use']} "
              f"({ws['kv_blocks']['peak_bytes_in_use'] / 2**20:.2f} MiB)")


def run(args: argparse.Namespace) -> int:
    import torch

    from wideserve.bench.throughput import hf_padding_allowed, materialise_hf_random_weights
    from wideserve.entrypoints.engine_args import engine_config_from_args
    from wideserve.worker.model_loader import read_config, resolve_dtype, resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    config = engine_config_from_args(args)
    config.cache.prefix_window_mode = args.prefix_window_mode
    model_dir = resolve_model_path(config.load.model)
    cfg_json = read_config(model_dir)
    want_hf = args.backend in ("hf", "both")
    if want_hf and not TRANSFORMERS.installed():
        print(f"wideserve bench throughput: error: "
              f"{TRANSFORMERS.message(f'--backend {args.backend}')}", file=sys.stderr)
        return 2
    if want_hf and args.hf_batch_size > 1 and not hf_padding_allowed(cfg_json):
        print("wideserve bench throughput: error: --hf-batch-size > 1 pads the batch, which "
              "transformers' DeepSeek-V4 does not support (right padding only); use 1",
              file=sys.stderr)
        return 2
    dtype = resolve_dtype(config.load.dtype, cfg_json)
    notes = []
    with tempfile.TemporaryDirectory(prefix="wideserve-bench-") as tmp:
        if config.load.load_format == "dummy" and want_hf:
            # Both backends must run the same weights: transformers' random init, saved once.
            model_dir = materialise_hf_random_weights(model_dir, dtype, config.load.seed,
                                                      Path(tmp))
            config.load.model, config.load.load_format = str(model_dir), "auto"
            notes.append("dummy weights: transformers' random init (seeded), shared by both")
        return _run_loaded(args, config, model_dir, cfg_json, dtype, notes)


def _run_loaded(args: argparse.Namespace, config: Any, model_dir: Path, cfg_json: dict,
                dtype: Any, notes: list[str]) -> int:
    from wideserve.bench.throughput import (build_llm, hf_warmup, load_hf_model,
                                            reset_prefix_cache, run_hf, run_wideserve)
    from wideserve.bench.datasets import token_pool
    want_ws, want_hf = args.backend in ("wideserve", "both"), args.backend in ("hf", "both")
    special = _special_ids(model_dir, config.load.tokenizer)
    requests = _requests(args, int(cfg_json["vocab_size"]), special)
    warm = requests[0].prompt_token_ids[0] if args.dataset == "random" else \
        token_pool(int(cfg_json["vocab_size"]), special)[-1].item()
    llm = build_llm(config, warm) if want_ws else None
    hf = load_hf_model(model_dir, dtype, config.load.device) if want_hf else None
    if hf is not None:
        hf_warmup(hf, warm)
    runs: dict[str, list] = {"wideserve": [], "transformers": []}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        if llm is not None:
            reset_prefix_cache(llm)
            res, outputs["wideserve"] = run_wideserve(llm, requests, args.ignore_eos,
                                                      use_tqdm=not args.no_progress)
            runs["wideserve"].append(res)
        if hf is not None:
            res, outputs["transformers"] = run_hf(hf, requests, args.hf_batch_size,
                                                  pad_token_id=int(cfg_json.get("pad_token_id")
                                                                   or 0))
            runs["transformers"].append(res)
    results = _results(args, cfg_json, dtype, runs, outputs, notes)
    if hf is not None and "wideserve" in outputs:
        results["divergence"] = _divergences(hf, requests, outputs["wideserve"],
                                             outputs["transformers"], dtype)
    _print_summary(results)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _results(args: argparse.Namespace, cfg_json: dict, dtype: Any, runs: dict[str, list],
             outputs: dict[str, list[list[int]]], notes: list[str]) -> dict[str, Any]:
    from wideserve.bench.throughput import median_result
    backends = {name: median_result(rs).to_dict() for name, rs in runs.items() if rs}
    for name, rs in runs.items():
        if rs:
            backends[name]["all_elapsed_s"] = [r.elapsed_s for r in rs]
    out: dict[str, Any] = {
        "command": command_line(args, "throughput"),
        "machine": machine_info(),
        "model": args.model or "bundled shakespeare-v4-tiny",
        "architecture": (cfg_json.get("architectures") or ["?"])[0],
        "dtype": str(dtype).split(".")[-1],
        "dataset": args.dataset, "num_requests": args.num_prompts,
        "workload": {k: getattr(args, k) for k in ("input_len", "output_len", "range_ratio",
                                                   "prefix_len", "num_prefixes", "ignore_eos")},
        "prefix_window_mode": args.prefix_window_mode, "repeats": args.repeats,
        "notes": notes, "backends": backends,
    }
    if "wideserve" in outputs and "transformers" in outputs:
        ws, hf = backends["wideserve"], backends["transformers"]
        out["ratio_output_tokens_per_s"] = ws["output_tokens_per_s"] / hf["output_tokens_per_s"]
        out["ratio_total_tokens_per_s"] = ws["total_tokens_per_s"] / hf["total_tokens_per_s"]
        out["identical_outputs"] = sum(a == b for a, b in zip(outputs["wideserve"],
                                                              outputs["transformers"]))
    if "wideserve" in outputs:
        out["wideserve_outputs"] = outputs["wideserve"]
    return out


# --- where greedy outputs part, and why ---
# The first differing output token of each request is explained from transformers' own logits
# (one teacher-forced forward, outside the timed runs) as one of:
# - "tie order": transformers' DeepSeek-V4 lightning indexer calls Tensor.topk, whose order
#   among equal scores is unspecified, while wideserve's picks the lowest index
#   (BENCHMARKS.md); under a stable top-k transformers itself prefers wideserve's token.
# - "near tie": the two tokens' logits are within NEAR_TIE_ULPS representable steps at the
#   top logit's magnitude (a bf16 logit of 10 has a step of 0.0625): the implementations'
#   different rounding (accumulation order, fused ops) decides the argmax.
# - otherwise a real difference, reported with its margin.
NEAR_TIE_ULPS = 8


@contextlib.contextmanager
def _stable_topk() -> Iterator[None]:
    """Tensor.topk with equal scores in lowest-index order (wideserve's indexer order)."""
    import torch
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):      # noqa: A002 (torch's name)
        s = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((s.values.narrow(dim, 0, k),
                                        s.indices.narrow(dim, 0, k)))
    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def _divergences(hf: Any, requests: list, ws_outs: list[list[int]], hf_outs: list[list[int]],
                 dtype: Any) -> list[dict[str, Any]]:
    """Each request whose outputs differ: the first differing position, both tokens,
    transformers' logit gap there (its token minus wideserve's) and the cause."""
    import torch
    device = next(hf.parameters()).device
    found = []
    for i, (req, ws, ref) in enumerate(zip(requests, ws_outs, hf_outs)):
        pos = next((k for k, (a, b) in enumerate(zip(ws, ref)) if a != b), None)
        if pos is None:
            continue
        ids = torch.tensor([list(req.prompt_token_ids) + ref[:pos]], device=device)
        with torch.inference_mode():
            logits = hf(input_ids=ids, use_cache=False).logits[0, -1].float()
            with _stable_topk():
                stable = hf(input_ids=ids, use_cache=False).logits[0, -1].float()
        gap = float(logits[ref[pos]] - logits[ws[pos]])
        stable_gap = float(stable[ref[pos]] - stable[ws[pos]])
        step = float(torch.finfo(dtype).eps) * 2.0 ** max(
            0, int(float(logits.abs().max())).bit_length() - 1)
        cause = ("tie order" if stable_gap < 0 <= gap
                 else "near tie" if min(abs(gap), abs(stable_gap)) <= NEAR_TIE_ULPS * step
                 else "difference")
        found.append({"request": i, "position": pos, "transformers_token": ref[pos],
                      "wideserve_token": ws[pos], "logit_gap": gap,
                      "logit_gap_stable_topk": stable_gap, "cause": cause})
    return found


def _divergence_line(found: list[dict[str, Any]], dtype: str) -> str:
    by = {c: [d for d in found if d["cause"] == c]
          for c in ("tie order", "near tie", "difference")}
    parts = []
    if by["tie order"]:
        parts.append(f"{len(by['tie order'])} from transformers' order among tied indexer "
                     f"scores (with lowest-index ties, as wideserve, it picks wideserve's token)")
    if by["near tie"]:
        parts.append(f"{len(by['near tie'])} at a near tie (top-2 logits within "
                     f"{max(abs(d['logit_gap']) for d in by['near tie']):.3g}: {dtype} "
                     f"rounding picks the winner)")
    if by["difference"]:
        worst = max(by["difference"], key=lambda d: abs(d["logit_gap"]))
        parts.append(f"{len(by['difference'])} at a clear margin (largest "
                     f"{abs(worst['logit_gap']):.3g}, request {worst['request']} output token "
                     f"{worst['position']}): a real difference")
    return (f"  the {len(found)} that differ part at their first differing token: "
            + "; ".join(parts) + "; the continuations differ after it")
