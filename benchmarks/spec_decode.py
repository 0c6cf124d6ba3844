"""Speculative decoding on the bundled model (BENCHMARKS.md, "Speculative decoding").

1. Acceptance: MTP at k = 1, 2, 3 and n-gram at k = 3, greedy, on prompts cut from the
   held-out Shakespeare stream (tools/tiny_data.py; the model never trained on it): mean
   acceptance length (AL = 1 + accepted / drafts), acceptance rate per draft position, and
   whether the outputs equal the non-speculative engine's (they must).
2. Throughput: batch 1, 8 and 64 concurrent requests (max_num_seqs = batch), 64-token prompts,
   128 greedy output tokens, without speculation and with MTP k = 1, 2, 3, at the device's
   default speculative depth per batch size (`batch_token_budget`: on the CPU k shrinks to fit
   32 verified tokens per step, so "k" is the most drafts per request). Runs are
   interleaved (none, k1, k2, k3, none, ...) so load changes on a shared machine hit every
   configuration alike. Reported per configuration: the median and the best (fastest) of the
   repeats, and the process CPU time (single-threaded, so it is the compute spent whatever the
   machine's load; the wall-clock figures move with other processes on a shared machine).
   output tok/s = all output tokens / wall time of the generate call;
   per-user tok/s = mean over requests of (output tokens - 1) / (last token - first token
   time), i.e. a user's decode speed after the first token (1 / TPOT);
   output tok/CPU-s = all output tokens / process CPU seconds of the generate call.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec_decode.py [--repeats 3] [--batches 1 8 64]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from wideserve import LLM, SamplingParams
from wideserve.bench.report import BUNDLED_MODEL_DIR, machine_info

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from tiny_data import held_out_stream

OUT = Path(__file__).parent / "results" / "spec_decode.json"
PROMPT_LEN, OUTPUT_LEN = 64, 128
ACCEPTANCE = {"none": None,
              **{f"mtp_k{k}": {"method": "mtp", "num_speculative_tokens": k} for k in (1, 2, 3)},
              "ngram_k3": {"method": "ngram", "num_speculative_tokens": 3}}
THROUGHPUT = ("none", "mtp_k1", "mtp_k2", "mtp_k3")
# Acceptance is measured at the full depth k (batch 32 would otherwise draft nothing under the
# device's speculative depth per batch size); throughput runs with the default depth.
FULL_DEPTH = {"batch_token_budget": 0}


def _prompts(stream, n: int, offset: int = 0) -> list[list[int]]:
    """n prompts of PROMPT_LEN tokens spread evenly over the held-out stream."""
    step = max(PROMPT_LEN, (len(stream) - PROMPT_LEN) // max(n, 1))
    return [stream[offset + i * step: offset + i * step + PROMPT_LEN].tolist()
            for i in range(n)]


def _llm(spec: dict | None, max_num_seqs: int) -> LLM:
    llm = LLM(None, dtype="float32", speculative_config=spec, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=4096, enable_prefix_caching=False,
              skip_tokenizer_init=True)
    llm.generate([{"prompt_token_ids": [7] * 8}],                        # warm-up
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return llm


def _generate(llm: LLM, prompts: list[list[int]]):
    sp = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    before = llm.engine.get_stats().spec_decode
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return outs, (elapsed, cpu), before, llm.engine.get_stats().spec_decode


def _acceptance(stream) -> dict:
    prompts = _prompts(stream, 32)
    out, base = {}, None
    for name, spec in ACCEPTANCE.items():
        spec = None if spec is None else {**spec, **FULL_DEPTH}
        outs, (elapsed, _), _, sd = _generate(_llm(spec, 32), prompts)
        tokens = [o.outputs[0].token_ids for o in outs]
        base = base or tokens
        row = {"spec": spec, "identical_to_no_spec": tokens == base, "elapsed_s": elapsed}
        if sd is not None:
            row.update(mean_acceptance_length=sd.mean_acceptance_length,
                       acceptance_rate=sd.acceptance_rate,
                       acceptance_rate_per_pos=sd.acceptance_rate_per_pos(),
                       num_drafts=sd.num_drafts, num_draft_tokens=sd.num_draft_tokens,
                       num_accepted_tokens=sd.num_accepted_tokens)
            print(f"{name:9s} AL {sd.mean_acceptance_length:.3f}  per position "
                  f"{[round(x, 3) for x in sd.acceptance_rate_per_pos()]}  identical "
                  f"{row['identical_to_no_spec']}", flush=True)
        out[name] = row
    return out


def _per_user(outs) -> float:
    speeds = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m is not None and n > 1 and m.last_token_time and m.first_token_time \
                and m.last_token_time > m.first_token_time:
            speeds.append((n - 1) / (m.last_token_time - m.first_token_time))
    return statistics.fmean(speeds) if speeds else float("nan")


def _throughput(stream, batches: list[int], repeats: int) -> dict:
    out = {}
    for batch in batches:
        prompts = _prompts(stream, batch, offset=PROMPT_LEN // 2)
        llms = {name: _llm(ACCEPTANCE[name], batch) for name in THROUGHPUT}
        runs: dict[str, list[dict]] = {name: [] for name in THROUGHPUT}
        loads, base = [], None
        for _ in range(repeats):
            for name in THROUGHPUT:
                outs, (elapsed, cpu), before, after = _generate(llms[name], prompts)
                tokens = [o.outputs[0].token_ids for o in outs]
                base = base or tokens
                n_out = sum(len(t) for t in tokens)
                al = None
                drafts = 0 if after is None else after.num_drafts - before.num_drafts
                if drafts:      # none at a batch size where the depth per batch size is 0
                    al = 1 + (after.num_accepted_tokens - before.num_accepted_tokens) / drafts
                runs[name].append({"elapsed_s": elapsed, "cpu_s": cpu,
                                   "output_tok_s": n_out / elapsed,
                                   "output_tok_per_cpu_s": n_out / cpu,
                                   "per_user_tok_s": _per_user(outs),
                                   "mean_acceptance_length": al,
                                   "identical_to_no_spec": tokens == base})
            loads.append(round(os.getloadavg()[0], 2))
        row = {"loadavg_1min_after_each_round": loads, "configs": {}}
        for name in THROUGHPUT:
            rs = runs[name]
            stat = {key: {"median": statistics.median(r[key] for r in rs),
                          "best": max(r[key] for r in rs)}
                    for key in ("output_tok_s", "per_user_tok_s", "output_tok_per_cpu_s")}
            als = [r["mean_acceptance_length"] for r in rs if r["mean_acceptance_length"]]
            row["configs"][name] = {
                **stat, "mean_acceptance_length": statistics.fmean(als) if als else None,
                "runs": rs, "identical_to_no_spec": all(r["identical_to_no_spec"] for r in rs)}
            ref, cur = row["configs"]["none"], row["configs"][name]

            def fmt(key: str, which: str, cur: dict = cur, ref: dict = ref) -> str:
                v = cur[key][which]
                return f"{v:7.1f} ({v / ref[key][which]:.2f}x)"

            print(f"batch {batch:3d} {name:7s} out tok/s median {fmt('output_tok_s', 'median')}"
                  f" best {fmt('output_tok_s', 'best')} | per user median "
                  f"{fmt('per_user_tok_s', 'median')} best {fmt('per_user_tok_s', 'best')} | "
                  f"tok/CPU-s {fmt('output_tok_per_cpu_s', 'median')} | AL "
                  f"{cur['mean_acceptance_length'] or 1:.2f}", flush=True)
        out[f"batch_{batch}"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    stream = held_out_stream(str(BUNDLED_MODEL_DIR))
    result = {"command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec_decode.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine_start": machine_info(), "model": "bundled shakespeare-v4-tiny (fp32)",
              "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN}
    result["acceptance"] = _acceptance(stream)
    result["throughput"] = _throughput(stream, args.batches, args.repeats)
    result["machine_end"] = machine_info()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    ok = all(r["identical_to_no_spec"] for r in result["acceptance"].values()) and all(
        c["identical_to_no_spec"] for b in result["throughput"].values()
        for c in b["configs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
