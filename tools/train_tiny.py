"""Train wideserve's bundled tiny DeepSeek-V4 model (+1 MTP block) on Shakespeare, on a CPU.

    .venv/bin/python tools/train_tiny.py --out wideserve/assets/shakespeare-v4-tiny --minutes 22

Pipeline: read the corpus (tools/tiny_data.py), train a byte-level BPE, encode, hold out the
last 5%, train transformers' `DeepseekV4ForCausalLM` jointly with one MTP block
(tools/tiny_v4.py; loss = main CE + 0.3 x MTP CE), save an HF-layout bf16 directory, then
measure the model-card numbers on the saved bf16 weights (tools/eval_tiny.py) and write README.md.

Routing balance is DeepSeek's aux-loss-free bias update with a deliberately small rate, so the
expert loads stay realistically skewed (the engine's EPLB has something to balance).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_data import (  # noqa: E402
    BOS,
    EOS,
    PAD,
    encode_stream,
    read_corpus,
    split_stream,
    train_tokenizer,
    write_tokenizer_files,
)
from train_loop import (  # noqa: E402
    RouterBalancer,
    TrainHooks,
    add_common_args,
    add_size_args,
    train_loop,
    write_training_info,
)
from tiny_v4 import (  # noqa: E402
    TinySizes,
    TinyV4WithMTP,
    build_config,
    init_hash_tables,
    joint_loss,
    save_model,
    topk_routers,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    add_size_args(p, TinySizes)
    return p.parse_args(argv)


@torch.no_grad()
def quick_val(model: TinyV4WithMTP, val: np.ndarray, seq: int, windows: int) -> tuple[float, float]:
    """Mean main/MTP CE over the first `windows` held-out windows of seq+2 tokens (training curve only)."""
    n = min(windows, (len(val) - 2) // seq)
    if n == 0:
        return float("nan"), float("nan")
    chunk = torch.from_numpy(np.stack([val[i * seq : i * seq + seq + 2] for i in range(n)]))
    model.eval()
    _, main, mtp = joint_loss(model, chunk, 0.0)
    model.train()
    return float(main), float(mtp)


def train(model: TinyV4WithMTP, train_ids: np.ndarray, val_ids: np.ndarray, args: argparse.Namespace) -> dict:
    def loss(chunk: torch.Tensor) -> tuple[torch.Tensor, str]:
        total, main, mtp = joint_loss(model, chunk, args.mtp_weight)
        return total, f"loss {float(main.detach()):.3f} mtp {float(mtp.detach()):.3f}"

    def validate() -> dict[str, float]:
        vm, vt = quick_val(model, val_ids, args.seq, args.eval_windows)
        return {"val_main": vm, "val_mtp": vt}

    balancer = RouterBalancer([m for _, m in topk_routers(model)], args.bias_rate,
                              lambda r: r.num_experts, lambda out: out[2])
    return train_loop(model, train_ids, args.seq + 2, args, TrainHooks(loss, validate, balancer))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    docs = read_corpus(args.corpus_limit_bytes)
    texts = [t for _, t in docs]
    tok = train_tokenizer(texts, args.vocab_size)
    ids = encode_stream(tok, texts)
    train_ids, val_ids = split_stream(ids)
    print(f"corpus {len(docs)} files {sum(map(len, texts))} chars -> {len(ids)} tokens "
          f"({len(train_ids)} train / {len(val_ids)} held out), vocab {tok.get_vocab_size()}", flush=True)

    sizes = TinySizes(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinySizes)})
    config = build_config(
        sizes, tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(PAD)
    )
    model = TinyV4WithMTP(config)
    init_hash_tables(model, torch.Generator().manual_seed(args.seed))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M, layers {config.layer_types}, mlp {config.mlp_layer_types}", flush=True)

    info = train(model, train_ids, val_ids, args)
    model.eval()
    save_model(model, args.out)
    write_tokenizer_files(tok, args.out, sizes.max_positions)
    info.update(
        command=".venv/bin/python tools/train_tiny.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        params=n_params,
        corpus_files=len(docs),
        corpus_chars=sum(map(len, texts)),
        corpus_tokens=int(len(ids)),
        held_out_tokens=int(len(val_ids)),
        total_wall_s=round(time.time() - t_start, 1),
        hparams={k: v for k, v in vars(args).items() if k not in ("out",)},
    )
    write_training_info(args.out, info)

    from eval_tiny import evaluate, write_card  # late import: eval needs the saved directory

    metrics = evaluate(
        args.out,
        limit_bytes=args.corpus_limit_bytes,
        max_windows=args.card_max_windows,
        sample_tokens=args.sample_tokens,
    )
    write_card(args.out, info, metrics)
    print(json.dumps(metrics, indent=2), flush=True)
    return metrics


if __name__ == "__main__":
    main()
