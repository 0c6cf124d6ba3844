"""Model-card numbers of the bundled tiny model, computed from the saved directory alone.

    .venv/bin/python tools/eval_tiny.py wideserve/assets/shakespeare-v4-tiny [--write-card]

Protocol (reproducible by any program that has the directory and the corpus):
- weights: the bf16 tensors of model.safetensors, upcast to fp32; all compute in fp32.
- held-out tokens: tools/tiny_data.py's stream (files sorted, `[bos] + ids + [eos]` per file,
  no other special tokens) with the directory's tokenizer.json; the last `n - n*95//100` tokens.
- windows: W = (len(heldout) - 1) // 256 non-overlapping windows; window i feeds tokens
  [256 i, 256 i + 256) at positions 0..255 with no cache (fresh context) and is scored on the
  next-token targets [256 i + 1, 256 i + 257). Val loss = mean CE over all W * 256 targets;
  perplexity = exp(val loss).
- MTP: in the same windows, the MTP block at position p (p = 0..254) gets the true token at p+1
  and predicts p+2. mtp_acc_text = mean[argmax MTP(p) == token p+2];
  mtp_acc_main = mean[argmax MTP(p) == argmax main(p+1)] (the greedy-verification acceptance).
- expert load: routed picks per expert over all W * 256 positions (main layers and MTP);
  skew = max / mean.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_data import held_out_stream, held_out_windows  # noqa: E402
from tiny_v4 import TinyV4WithMTP, all_routers, load_model  # noqa: E402

WINDOW = 256
SAMPLE_PROMPTS = ("Romeo.\n", "King Henry.\nMy lord,")


def _load_counters(model: TinyV4WithMTP) -> dict[str, torch.Tensor]:
    counts: dict[str, torch.Tensor] = {}
    for name, router in all_routers(model):
        key = name.removeprefix("lm.").removesuffix(".mlp.gate")
        counts[key] = torch.zeros(router.num_experts)

        def hook(module, _args, out, key=key):  # noqa: ANN001
            counts[key] += torch.bincount(out[2].reshape(-1), minlength=module.num_experts).float()

        router.register_forward_hook(hook)
    return counts


@torch.no_grad()
def evaluate(
    model_dir: str,
    limit_bytes: int | None = None,
    max_windows: int | None = None,
    batch: int = 8,
    sample_tokens: int = 60,
) -> dict:
    model = load_model(model_dir, torch.float32)
    val = held_out_stream(model_dir, limit_bytes)
    n_win = held_out_windows(val, WINDOW, max_windows)
    counts = _load_counters(model)
    main_nll = mtp_nll = 0.0
    acc_text = acc_main = 0
    n_main = n_mtp = 0
    for b0 in range(0, n_win, batch):
        starts = range(b0 * WINDOW, min(b0 + batch, n_win) * WINDOW, WINDOW)
        x = torch.from_numpy(np.stack([val[s : s + WINDOW] for s in starts]))  # [b, 256]
        y = torch.from_numpy(np.stack([val[s + 1 : s + WINDOW + 1] for s in starts]))  # [b, 256]
        main_logits, mtp_logits = model(x, y)  # MTP at p sees the true token p+1 = y[:, p]
        vocab = main_logits.shape[-1]
        main_nll += float(F.cross_entropy(main_logits.reshape(-1, vocab), y.reshape(-1), reduction="sum"))
        n_main += y.numel()
        drafts = mtp_logits[:, :-1]  # [b, 255, V] predicting y[:, 1:]
        mtp_nll += float(F.cross_entropy(drafts.reshape(-1, vocab), y[:, 1:].reshape(-1), reduction="sum"))
        guess = drafts.argmax(-1)
        acc_text += int((guess == y[:, 1:]).sum())
        acc_main += int((guess == main_logits[:, 1:].argmax(-1)).sum())
        n_mtp += guess.numel()
    val_loss = main_nll / n_main
    loads = {k: {"max_over_mean": round(float(c.max() / c.mean()), 3), "counts": [int(v) for v in c]}
             for k, c in counts.items()}
    return {
        "windows": n_win,
        "targets": n_main,
        "val_loss": round(val_loss, 4),
        "val_ppl": round(math.exp(val_loss), 2),
        "mtp_val_loss": round(mtp_nll / n_mtp, 4),
        "mtp_acc_text": round(acc_text / n_mtp, 4),
        "mtp_acc_main": round(acc_main / n_mtp, 4),
        "expert_load": loads,
        "samples": samples(model, model_dir, sample_tokens),
    }


@torch.no_grad()
def samples(model: TinyV4WithMTP, model_dir: str, new_tokens: int = 60) -> list[dict]:
    """Greedy and temperature-0.8 (seed 0) continuations with HF generate on the main model."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    bos = model.lm.config.bos_token_id
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([[bos, *tok.encode(prompt, add_special_tokens=False).ids]])
        modes = (("greedy", {"do_sample": False}), ("t=0.8", {"do_sample": True, "temperature": 0.8, "top_k": 0}))
        for mode, kw in modes:
            torch.manual_seed(0)
            gen = model.lm.generate(ids, max_new_tokens=new_tokens, pad_token_id=bos, **kw)
            out.append({"prompt": prompt, "mode": mode, "text": tok.decode(gen[0, ids.shape[1]:].tolist())})
    return out


def dir_size_bytes(model_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir))


def write_card(model_dir: str, info: dict, metrics: dict) -> None:
    from card_tiny import render_card  # the long markdown lives in its own file

    with open(os.path.join(model_dir, "eval_results.json"), "w") as f:
        json.dump(metrics, f, indent=2)
        f.write("\n")
    text = render_card(model_dir, info, metrics)
    with open(os.path.join(model_dir, "README.md"), "w") as f:
        f.write(text)


def main(argv: list[str] | None = None, evaluate_fn=evaluate, write_card_fn=write_card,  # noqa: ANN001
         doc: str | None = __doc__) -> None:
    """The CLI of this file and of tools/eval_tiny_v41.py (which passes its own functions)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--corpus-limit-bytes", type=int, default=None)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write-card", action="store_true", help="rewrite README.md (needs training_info.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    metrics = evaluate_fn(args.model_dir, args.corpus_limit_bytes, args.max_windows)
    if args.write_card:
        with open(os.path.join(args.model_dir, "training_info.json")) as f:
            write_card_fn(args.model_dir, json.load(f), metrics)
    print(json.dumps({k: v for k, v in metrics.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()
