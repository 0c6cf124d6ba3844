"""DeepSeek-V4.1 exact decoder bounded replay: prefill tokens/s on a cached prefix, before and
after (BENCHMARKS.md, "DeepSeek-V4.1: exact decoder bounded replay").

The recipe measures 4K / 32K / 64K new tokens on a 128K cached prefix of V4.1-Flash (40
layers, 20 of them from the last KV source on, window 128) on GPUs. Scaled to what a shared
2-core CPU runs in minutes: a V4.1-shaped model of 8 layers (an SWA layer, a ratio-2 KV source
at 1 with two reuse layers, the ratio-1 candidate source at 4, reindex layers at 5 and 7, a
reuse layer at 6: 4 encoder + 4 decoder layers against Flash's 20 + 20), narrow (hidden 256,
8 heads x 128, indexer 8 x 64, top-k 512, 2,048 candidate blocks of 8, 8 experts top-2), the
window kept at 128; new tokens divided by 16: 256 / 2K / 4K on a 4K cached prefix (128K / 32)
(`--new`, `--prefix`), each prompt's new tokens in one step. The exact replay keeps
1 + 4 x 127 = 509 rows at the source (Flash: 2,541 = 1 + 20 x 127), so 2K / 4K new tokens here
keep about the share of rows that 16K / 32K keep on Flash. Random (dummy) weights, fp32, one
engine with prefix caching (prefix_window_mode "keep": the hit keeps the windows).

Modes, alternating within each round (a fresh suffix per timing, the same cached prefix):
- off: every layer on every row (main's default before this change; `--no-decoder-bounded-
  replay` now);
- approx: main's old `--decoder-bounded-replay` row choice: the source on every row, the
  layers after it on each request's last `window` rows (approximate; emulated here through
  the replay's row-start function, same sub-batches as the old code);
- exact: the new default (models/deepseek_v41/replay.py).
Times one `generate(max_tokens=1)` per prompt (the prefill and one sampled token).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/v41_replay.py \
        [--new 256 2048 4096] [--prefix 4096] [--rounds 2] [--threads 1] [--modes off exact]

V41_REPLAY_OUT overrides where the JSON results go.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from wideserve import LLM, SamplingParams
from wideserve.bench.report import machine_info
from wideserve.models.deepseek_v41 import replay

OUT = Path(os.environ.get("V41_REPLAY_OUT",
                         Path(__file__).parent / "results" / "v41_replay.json"))
LAYERS = 8
SOURCE = 4            # the last KV source (the candidate source)
WINDOW = 128
TEXT = dict(vocab_size=1024, hidden_size=256, moe_intermediate_size=128,
            num_hidden_layers=LAYERS, num_attention_heads=8, head_dim=128, q_lora_rank=128,
            o_groups=2, o_lora_rank=64, n_routed_experts=8, num_experts_per_tok=2,
            sliding_window=WINDOW, index_n_heads=8, index_head_dim=64, index_topk=512,
            hc_mult=4, hc_sinkhorn_iters=20, qk_rope_head_dim=32,
            compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1],
            kv_source_layer_ids=[1, SOURCE], index_source_layer_ids=[1, SOURCE, 5, 7],
            candidate_source_layer_id=SOURCE, candidate_topk_blocks=2048,
            candidate_block_size=8, engram_layer_ids=[], engram_num_embeddings=[],
            rms_norm_eps=1e-6, num_nextn_predict_layers=0, max_position_embeddings=1 << 17)
MODES = ("off", "approx", "exact")
# Values stored as they are (the same quantised values as the packed records, "raw"): on this
# CPU unpacking the packed FP4 records of every read dominates a long prefill (~80% of it),
# which would put the runs out of reach of minutes.
KV_DTYPE = "raw"


def _approx_starts(ctx, seq, need, window, layer, num_layers):   # noqa: ANN001, ANN202
    """main's old row choice (see the module doc)."""
    return ctx if layer == SOURCE else np.maximum(ctx, seq - window)


def _llm(tmp: Path, max_new: int) -> LLM:
    (tmp / "config.json").write_text(json.dumps(
        {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
         "text_config": TEXT, "torch_dtype": "float32",
         "max_position_embeddings": TEXT["max_position_embeddings"]}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(str(tmp), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
                   enable_prefix_caching=True, max_num_batched_tokens=max(max_new, 2048),
                   kv_cache_memory=1 << 30, max_num_seqs=4, kv_cache_dtype=KV_DTYPE)


def _set_mode(llm: LLM, mode: str, exact_starts) -> None:   # noqa: ANN001
    llm.engine.model.decoder_replay = mode != "off"
    replay.replay_starts = _approx_starts if mode == "approx" else exact_starts


def _prefill(llm: LLM, prompt: list[int]) -> float:
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new", type=int, nargs="+", default=[256, 2048, 4096])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = np.random.default_rng(0)
    exact_starts = replay.replay_starts
    prefix = g.integers(3, 1024, args.prefix).tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        llm = _llm(Path(tmp), max(args.new))
        _set_mode(llm, "off", exact_starts)
        _prefill(llm, prefix)                       # cache the prefix
        _prefill(llm, prefix + g.integers(3, 1024, 256).tolist())      # warm up
        for n in args.new:
            modes = [m for m in MODES if m in args.modes]
            times: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(args.rounds):
                order = modes if r % 2 == 0 else modes[::-1]
                for mode in order:
                    _set_mode(llm, mode, exact_starts)
                    times[mode].append(_prefill(llm, prefix + g.integers(3, 1024, n).tolist()))
            med = {m: float(np.median(t)) for m, t in times.items()}
            row = dict(new_tokens=n, prefix=args.prefix, seconds=times,
                       tokens_per_s={m: n / med[m] for m in modes},
                       load=os.getloadavg()[0])
            for m in ("off", "approx"):
                if m in med and "exact" in med:
                    row[f"exact_over_{m}"] = med[m] / med["exact"]
            rows.append(row)
            print(f"{n:6d} new on {args.prefix}: tok/s " + "  ".join(
                f"{m} {n / med[m]:8.1f}" for m in modes) + "".join(
                f"  exact/{m} {row[f'exact_over_{m}']:.3f}x" for m in ("off", "approx")
                if f"exact_over_{m}" in row) + f"  (load {row['load']:.1f})", flush=True)
        _set_mode(llm, "exact", exact_starts)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(dict(machine=machine_info(), layers=LAYERS, source=SOURCE,
                                   window=WINDOW, text_config=TEXT, rounds=args.rounds,
                                   threads=args.threads, rows=rows), indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
