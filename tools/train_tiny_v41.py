"""Train wideserve's bundled tiny DeepSeek-V4.1 (+ its DSpark drafter) on Shakespeare, on a CPU.

    .venv/bin/python tools/train_tiny_v41.py --out wideserve/assets/shakespeare-v41-tiny --minutes 50

Same corpus, tokenizer (the bundled V4's tokenizer.json, reused as it is) and held-out split
as the bundled V4 (tools/tiny_data.py). The models are the reference implementation's
(tools/tiny_v41.py): backbone loss = next-token CE; the DSpark drafter trains jointly on the
backbone's detached tap features (its loss never moves the backbone). Router balance: the
aux-loss-free bias update of tools/train_tiny.py on every gate. Writes an HF-layout bf16
directory, then the model card (tools/eval_tiny_v41.py on the saved weights; the same
`eval_tiny_v41.py DIR --write-card` redoes it from a saved directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_data import encode_stream, read_corpus, split_stream  # noqa: E402
from tiny_v41 import (  # noqa: E402
    TinyV41,
    TinyV41Sizes,
    compressed_vocab_size,
    engram_rows,
    hf_tokenizer,
    routers,
    save_model,
    text_config,
)
from train_loop import RouterBalancer, TrainHooks, add_common_args, add_size_args, train_loop, write_training_info  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V4_DIR = os.path.join(ROOT, "wideserve", "assets", "shakespeare-v4-tiny")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.set_defaults(lr=3e-3, eval_every_s=180.0, eval_windows=8)
    p.add_argument("--tokenizer-dir", default=V4_DIR, help="directory whose tokenizer files are reused")
    p.add_argument("--anchors", type=int, default=16, help="DSpark blocks per sequence per step")
    p.add_argument("--dspark-weight", type=float, default=1.0)
    p.add_argument("--save-every-s", type=float, default=600.0, help="intermediate saves (crash safety)")
    add_size_args(p, TinyV41Sizes)
    return p.parse_args(argv)


@torch.no_grad()
def quick_val(model: TinyV41, val: np.ndarray, seq: int, windows: int) -> dict:
    """Main CE and the drafter's terms over the first `windows` held-out windows (curve only)."""
    n = min(windows, (len(val) - 1) // seq)
    chunk = torch.from_numpy(np.stack([val[i * seq: i * seq + seq + 1] for i in range(n)]))
    model.eval()
    main, met, _ = model(chunk)
    model.train()
    return {"val_main": float(main), "val_dspark_ce": float(met.ce_loss),
            "val_dspark_tau": float(met.tau_num / met.tau_den.clamp(min=1))}


def train(model: TinyV41, train_ids: np.ndarray, val_ids: np.ndarray, args: argparse.Namespace) -> dict:
    def loss(chunk: torch.Tensor) -> tuple[torch.Tensor, str]:
        model.sync_draft_head()
        main, met, _ = model(chunk)
        terms = {k: float(v.detach()) for k, v in (("loss", main), ("dspark ce", met.ce_loss),
                                                    ("l1", met.l1_loss), ("conf", met.confidence_loss))}
        terms["tau"] = float(met.tau_num / met.tau_den.clamp(min=1))
        return main + args.dspark_weight * met.loss, " ".join(f"{k} {v:.3f}" for k, v in terms.items())

    balancer = RouterBalancer([m for _, m in routers(model)], args.bias_rate,
                              lambda g: g.n_experts, lambda out: out[1])
    hooks = TrainHooks(loss, lambda: quick_val(model, val_ids, args.seq, args.eval_windows), balancer,
                       save=lambda: save_model(model, args.out))
    return train_loop(model, train_ids, args.seq + 1, args, hooks)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(args.tokenizer_dir, name), os.path.join(args.out, name))
    tok = hf_tokenizer(os.path.join(args.out, "tokenizer.json"))
    docs = read_corpus(args.corpus_limit_bytes)
    texts = [t for _, t in docs]
    ids = encode_stream(tok.backend_tokenizer, texts)
    train_ids, val_ids = split_stream(ids)
    print(f"corpus {len(docs)} files -> {len(ids)} tokens ({len(train_ids)} train / "
          f"{len(val_ids)} held out), vocab {len(tok)}", flush=True)
    sizes = TinyV41Sizes(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinyV41Sizes)})
    cfg = text_config(sizes, len(tok), compressed_vocab_size(tok), engram_rows(sizes))
    model = TinyV41(cfg, tok, num_anchors=args.anchors)
    n_lm = sum(p.numel() for p in model.lm.parameters())
    n_draft = sum(p.numel() for n, p in model.draft.named_parameters() if n.startswith("mtp."))
    print(f"params backbone {n_lm / 1e6:.2f}M, DSpark stages {n_draft / 1e6:.2f}M", flush=True)

    info = train(model, train_ids, val_ids, args)
    model.eval()
    save_model(model, args.out)
    info.update(
        command=".venv/bin/python tools/train_tiny_v41.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        params_backbone=n_lm, params_dspark=n_draft, corpus_files=len(docs),
        corpus_tokens=int(len(ids)), held_out_tokens=int(len(val_ids)),
        total_wall_s=round(time.time() - t_start, 1),
        hparams={k: v for k, v in vars(args).items() if k not in ("out", "tokenizer_dir")})
    write_training_info(args.out, info)

    from eval_tiny_v41 import evaluate, write_card  # late import: eval needs the saved directory

    metrics = evaluate(args.out, limit_bytes=args.corpus_limit_bytes,
                       max_windows=args.card_max_windows, sample_tokens=args.sample_tokens)
    write_card(args.out, info, metrics)
    print(json.dumps({k: v for k, v in metrics.items() if k != "samples"}, indent=2), flush=True)
    return metrics


if __name__ == "__main__":
    main()
