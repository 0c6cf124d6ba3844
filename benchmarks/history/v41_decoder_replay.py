"""DeepSeek-V4.1 decoder bounded replay on vs off (BENCHMARKS.md, "DeepSeek-V4.1: decoder
bounded replay"): prefill time and output agreement.

The dummy V4.1 model of benchmarks/v41_decode_context.py (12 layers, the last KV source at
layer 6, window 128; random weights) served by the engine with prefix caching off and the
whole prompt in one step. Per prompt length: time a 1-token generation (the prefill) with the
replay off and on, alternating, median of 3; then greedy 16 tokens both ways over 8 prompts:
the share of identical continuations and of identical first tokens.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/history/v41_decoder_replay.py [prompt lengths]

The engine option is `--decoder-bounded-replay` / `LLM(decoder_bounded_replay=True)`; here one
engine flips the model's switch between runs so that on and off alternate on the same caches.
V41_REPLAY_OUT overrides where the results go.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from v41_decode_context import COMMON  # noqa: E402

from wideserve import LLM, SamplingParams  # noqa: E402
from wideserve.bench.report import machine_info  # noqa: E402

OUT = Path(os.environ.get("V41_REPLAY_OUT",
                         Path(__file__).parents[1] / "results" / "v41_decoder_replay.json"))


def _llm(tmp: Path) -> LLM:
    text = dict(COMMON, qk_rope_head_dim=32, compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1],
                kv_source_layer_ids=[2, 6], index_source_layer_ids=[2, 6, 8, 10],
                candidate_source_layer_id=6, candidate_topk_blocks=2048, candidate_block_size=8,
                engram_layer_ids=[], engram_num_embeddings=[], rms_norm_eps=1e-6,
                num_nextn_predict_layers=0, max_position_embeddings=16384)
    (tmp / "config.json").write_text(json.dumps(
        {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
         "text_config": text, "torch_dtype": "float32", "max_position_embeddings": 16384}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(str(tmp), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
                   enable_prefix_caching=False, max_num_batched_tokens=8192,
                   kv_cache_memory=1 << 30, max_num_seqs=8)


def _run(llm: LLM, prompts, n: int) -> tuple[float, list[list[int]]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    torch.set_num_threads(1)
    g = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        llm = _llm(Path(tmp))
        model = llm.engine.model
        for length in [int(a) for a in sys.argv[1:]] or [512, 1024]:
            prompt = [g.integers(3, 1024, length).tolist()]
            times = {False: [], True: []}
            for _ in range(3):
                for on in (False, True):
                    model.decoder_replay = on
                    times[on].append(_run(llm, prompt, 1)[0])
            prompts = [g.integers(3, 1024, length).tolist() for _ in range(8)]
            outs = {}
            for on in (False, True):
                model.decoder_replay = on
                outs[on] = _run(llm, prompts, 16)[1]
            model.decoder_replay = False
            row = {"prompt": length,
                   "prefill_s_off": float(np.median(times[False])),
                   "prefill_s_on": float(np.median(times[True])),
                   "same_continuation": float(np.mean([a == b for a, b in
                                                       zip(outs[False], outs[True])])),
                   "same_first_token": float(np.mean([a[0] == b[0] for a, b in
                                                      zip(outs[False], outs[True])]))}
            row["speedup"] = row["prefill_s_off"] / row["prefill_s_on"]
            rows.append(row)
            print(row, flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": machine_info(), "rows": rows,
                               "command": " ".join(sys.argv)}, indent=1))


if __name__ == "__main__":
    main()
