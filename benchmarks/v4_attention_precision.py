"""DeepSeek-V4 attention precision: logits with the attention products (q.k, p.v) and the
indexer's q.k in the model dtype (bf16) against the same model with them in fp32
(docs/deepseek_v4.md, "Attention precision"; BENCHMARKS.md, same title).

Everything else is identical (bf16 weights, fp32 norms / mHC / sinks, the same KV cache in
bf16; softmax, masks, sinks and top-k always fp32). Per model: R requests prefill L tokens in
one step (chunks of LONG_QUERY-query blocks), then decode `--decode` steps on the greedy
tokens of the fp32 variant (teacher-forced, so every variant sees the same inputs). Reported
per variant: max and mean |dlogit| against fp32, the largest logit magnitude, and the share of
positions whose argmax differs.

Models: the bundled trained V4 (wideserve/assets, text from its held-out stream) and the
V4-Flash-shaped dummy of benchmarks/v4_decode_context.py (random token ids, prompts longer
than 4 x index_topk so that its indexer selects).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/v4_attention_precision.py [--len 600]
        [--dummy-len 2304] [--reqs 3] [--decode 16]
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from wideserve.bench.report import machine_info
from wideserve.config import LoadConfig
from wideserve.worker.model_loader import BUNDLED_MODEL, load_model

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from v4_decode_context import Batch, set_precision, v4_model  # noqa: E402

# (attention products, indexer q.k): "model" = the model dtype
VARIANTS = {"fp32": (torch.float32, torch.float32),
            "attn_bf16": ("model", torch.float32),
            "attn_bf16+index_bf16": ("model", "model")}


def held_out_tokens(n: int) -> list[int]:
    sys.path.insert(0, str(HERE.parent / "tools"))
    from tiny_data import held_out_stream
    return held_out_stream(str(BUNDLED_MODEL)).tolist()[:n]


def _logits(model, prompts: list[list[int]], forced: list[list[int]]) -> torch.Tensor:
    """fp32 logits of the prefill's tokens then of each teacher-forced decode step."""
    batch = Batch(model, [0] * len(prompts), 256, extra=max(map(len, prompts)) + len(forced))
    out = [batch.forward(prompts)[0].float()]
    out += [batch.forward([[t] for t in toks])[0].float() for toks in forced]
    return torch.cat(out)


def _greedy(model, prompts: list[list[int]], decode: int) -> list[list[int]]:
    batch = Batch(model, [0] * len(prompts), 256, extra=max(map(len, prompts)) + decode)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    toks = batch.forward(prompts)[0][ends].argmax(-1).tolist()
    forced = [toks]
    for _ in range(decode - 1):
        forced.append(batch.forward([[t] for t in forced[-1]])[0].argmax(-1).tolist())
    return forced


def _diff(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (got - ref).abs()
    return {"max_abs_dlogit": d.max().item(), "mean_abs_dlogit": d.mean().item(),
            "argmax_differs": (got.argmax(-1) != ref.argmax(-1)).float().mean().item()}


def run(model, prompts: list[list[int]], decode: int) -> dict[str, dict]:
    """Each variant's logits against the fp32 attention path of the same bf16 model, over the
    same prefill + teacher-forced decode; plus, as a yardstick, the fp32 path of the same
    weights in an fp32 model against the bf16 model's fp32 path (the error bf16 already
    costs outside attention)."""
    set_precision(model, torch.float32, torch.float32)
    forced = _greedy(model, prompts, decode)
    logits = {}
    for name, (attn, index) in VARIANTS.items():
        set_precision(model, attn, index)
        logits[name] = _logits(model, prompts, forced)
    set_precision(model, None, None)
    ref = logits["fp32"]
    rows = {name: _diff(got, ref) for name, got in logits.items() if name != "fp32"}
    wide = copy.deepcopy(model).float()
    set_precision(wide, torch.float32, torch.float32)
    rows["yardstick: fp32 model vs bf16 model, both fp32 attention"] = _diff(
        ref, _logits(wide, prompts, forced))
    rows["max_abs_logit"] = ref.abs().max().item()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--len", type=int, default=600, help="bundled model: prompt tokens per request")
    ap.add_argument("--dummy-len", type=int, default=2304,
                    help="dummy model: prompt tokens per request (> 4 x index_topk = 2048, so "
                         "the indexer selects)")
    ap.add_argument("--reqs", type=int, default=3)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "v4_attention_precision.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    bundled = load_model(LoadConfig(dtype="bfloat16")).model
    text = held_out_tokens(args.len * args.reqs)
    results = {"bundled": run(bundled, [text[i * args.len:(i + 1) * args.len]
                                        for i in range(args.reqs)], args.decode)}
    dummy = v4_model(torch.bfloat16)
    vocab = dummy.config.vocab_size
    results["v4_flash_shaped_dummy"] = run(
        dummy, [torch.randint(0, vocab, (args.dummy_len,)).tolist() for _ in range(args.reqs)],
        args.decode)
    print(json.dumps(results, indent=1))
    record = {"results": results, "machine": machine_info(), "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
