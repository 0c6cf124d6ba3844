"""DSpark on the bundled tiny V4.1 against MTP on the bundled tiny V4 (BENCHMARKS.md, "DSpark").

Both models share the corpus, tokenizer and held-out split, so the prompts are the same token
ids: 64-token windows of the held-out Shakespeare stream (tools/tiny_data.py), 128 greedy output
tokens, EOS ignored, fp32, one thread, no prefix caching. Each method is measured against its
own model's no-speculation baseline in the same run (the two models differ in size and speed):

- V4 (shakespeare-v4-tiny): none, MTP k = 1, 2, 3;
- V4.1 (shakespeare-v41-tiny): none, DSpark k = 3, 5, and DSpark k = 5 with the confidence
  early stop at thresholds --thresholds (drafting stops at the first slot whose predicted
  acceptance is below the threshold).

`batch_token_budget` 0 everywhere: k is the depth at every batch size (the device default would
cut k at batch 8; benchmarks/spec_decode.py measures that default). Runs are interleaved
(every configuration once per round) so load changes hit all alike; reported: median over the
rounds of output tok/s, its ratio to the same model's none, the mean acceptance length
(AL = 1 + accepted / drafts) and drafted tokens per verification; outputs must equal the
model's non-speculative ones (exit 1 otherwise).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec_dspark.py [--repeats 3] [--batches 1 8]
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
from tiny_data import held_out_stream  # noqa: E402

V41_DIR = BUNDLED_MODEL_DIR.parent / "shakespeare-v41-tiny"
OUT = Path(__file__).parent / "results" / "spec_dspark.json"
PROMPT_LEN, OUTPUT_LEN = 64, 128


def _configs(thresholds: list[float]) -> dict[str, tuple[str, dict | None]]:
    spec = lambda method, k, **kw: {"method": method, "num_speculative_tokens": k,  # noqa: E731
                                    "batch_token_budget": 0, **kw}
    out: dict[str, tuple[str, dict | None]] = {"v4_none": ("v4", None)}
    out.update({f"v4_mtp_k{k}": ("v4", spec("mtp", k)) for k in (1, 2, 3)})
    out["v41_none"] = ("v41", None)
    out.update({f"v41_dspark_k{k}": ("v41", spec("dspark", k)) for k in (3, 5)})
    out.update({f"v41_dspark_k5_conf{t:g}": ("v41", spec("dspark", 5, dspark_confidence_threshold=t))
                for t in thresholds})
    return out


def _prompts(stream, n: int) -> list[list[int]]:
    step = max(PROMPT_LEN, (len(stream) - PROMPT_LEN) // max(n, 1))
    return [stream[PROMPT_LEN // 2 + i * step: PROMPT_LEN // 2 + i * step + PROMPT_LEN].tolist()
            for i in range(n)]


def _llm(path: Path, spec: dict | None, batch: int) -> LLM:
    llm = LLM(str(path), dtype="float32", speculative_config=spec, max_num_seqs=batch,
              max_num_batched_tokens=4096, enable_prefix_caching=False, skip_tokenizer_init=True)
    llm.generate([{"prompt_token_ids": [7] * 8}],                        # warm-up
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return llm


def _run(llm: LLM, prompts: list[list[int]]) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    before = llm.engine.get_stats().spec_decode
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = llm.engine.get_stats().spec_decode
    tokens = [o.outputs[0].token_ids for o in outs]
    row = {"elapsed_s": elapsed, "output_tok_s": sum(map(len, tokens)) / elapsed,
           "tokens": tokens}
    if after is not None:
        drafts = after.num_drafts - before.num_drafts
        row["acceptance_length"] = 1 + (after.num_accepted_tokens - before.num_accepted_tokens) / drafts
        row["drafted_per_verification"] = (after.num_draft_tokens - before.num_draft_tokens) / drafts
        row["accepted_per_pos"] = [(a - b) / drafts for a, b in zip(
            after.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos)]
    return row


def _batch(stream, batch: int, repeats: int, configs: dict, paths: dict) -> dict:
    prompts = _prompts(stream, batch)
    llms = {name: _llm(paths[model], spec, batch) for name, (model, spec) in configs.items()}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    loads = []
    for _ in range(repeats):
        for name in configs:
            runs[name].append(_run(llms[name], prompts))
        loads.append(round(os.getloadavg()[0], 2))
    rows: dict[str, dict] = {}
    for name, (model, spec) in configs.items():
        rs, base = runs[name], runs[f"{model}_none"]
        tok_s = statistics.median(r["output_tok_s"] for r in rs)
        row = {"spec": spec, "output_tok_s_median": tok_s,
               "speedup_vs_own_none": tok_s / statistics.median(r["output_tok_s"] for r in base),
               "identical_to_no_spec": all(r["tokens"] == base[0]["tokens"] for r in rs),
               "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rs]}
        if spec is not None:
            for key in ("acceptance_length", "drafted_per_verification"):
                row[key] = statistics.fmean(r[key] for r in rs)
            row["accepted_per_pos"] = [statistics.fmean(x) for x in zip(*(r["accepted_per_pos"] for r in rs))]
        rows[name] = row
        print(f"batch {batch} {name:22s} out tok/s {tok_s:7.1f} ({row['speedup_vs_own_none']:.2f}x) "
              f"AL {row.get('acceptance_length', 1):.2f} drafted {row.get('drafted_per_verification', 0):.2f} "
              f"identical {row['identical_to_no_spec']}", flush=True)
    return {"loadavg_1min_after_each_round": loads, "configs": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    ap.add_argument("--v41", type=Path, default=V41_DIR, help="the V4.1 model directory")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    stream = held_out_stream(str(BUNDLED_MODEL_DIR))
    configs = _configs(args.thresholds)
    paths = {"v4": BUNDLED_MODEL_DIR, "v41": args.v41}
    result = {"command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec_dspark.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine_start": machine_info(), "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
              "batches": {}}
    for batch in args.batches:
        result["batches"][str(batch)] = _batch(stream, batch, args.repeats, configs, paths)
    result["machine_end"] = machine_info()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(c["identical_to_no_spec"] for b in result["batches"].values()
                    for c in b["configs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
