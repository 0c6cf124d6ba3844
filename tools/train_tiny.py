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
import math
import os
import shlex
import sys
import time
from collections.abc import Callable

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
from tiny_v4 import (  # noqa: E402
    TinySizes,
    TinyV4WithMTP,
    build_config,
    init_hash_tables,
    joint_loss,
    save_model,
    topk_routers,
)


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The flags every tiny-model trainer has (tools/train_tiny.py, tools/train_tiny_v41.py)."""
    p.add_argument("--out", required=True, help="output model directory")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--minutes", type=float, help="wall-clock training budget")
    budget.add_argument("--steps", type=int, help="number of optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-limit-bytes", type=int, default=None, help="use only this much text (smoke tests)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bias-rate", type=float, default=2e-4, help="aux-loss-free router bias step")
    p.add_argument("--eval-every-s", type=float, default=120.0)
    p.add_argument("--eval-windows", type=int, default=16, help="windows in the periodic (partial) val")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--card-max-windows", type=int, default=None, help="limit final eval windows (smoke tests)")
    p.add_argument("--sample-tokens", type=int, default=60, help="new tokens per model-card sample")


def add_size_args(p: argparse.ArgumentParser, sizes: type) -> None:
    for f in dataclasses.fields(sizes):
        p.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    add_size_args(p, TinySizes)
    return p.parse_args(argv)


class RouterBalancer:
    """Counts top-k picks per router during training steps (grad enabled) and nudges each
    router's e_score_correction_bias: `picks(output)` reads the expert ids from its output."""

    def __init__(self, routers: list[torch.nn.Module], rate: float, n_experts: Callable[[torch.nn.Module], int],
                 picks: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]) -> None:
        self.rate = rate
        self.routers = routers
        self.counts = [torch.zeros(n_experts(r)) for r in routers]
        for r, c in zip(routers, self.counts):
            r.register_forward_hook(self._hook(c, picks))

    @staticmethod
    def _hook(counts: torch.Tensor, picks: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]):
        def hook(_module: torch.nn.Module, _args: object, out: tuple[torch.Tensor, ...]) -> None:
            if torch.is_grad_enabled():
                counts.add_(torch.bincount(picks(out).reshape(-1), minlength=counts.numel()).float())

        return hook

    @torch.no_grad()
    def step(self) -> None:
        for r, c in zip(self.routers, self.counts):
            r.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            c.zero_()


def lr_at(args: argparse.Namespace, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / args.warmup)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * warm * (args.min_lr_frac + (1.0 - args.min_lr_frac) * cos)


def make_optimizer(model: TinyV4WithMTP, args: argparse.Namespace) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


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
    opt = make_optimizer(model, args)
    balancer = RouterBalancer([m for _, m in topk_routers(model)], args.bias_rate,
                              lambda r: r.num_experts, lambda out: out[2])
    rng = np.random.default_rng(args.seed)
    span = args.seq + 2
    if len(train_ids) <= span:
        raise ValueError(f"training stream has {len(train_ids)} tokens, need more than {span}")
    budget_s = args.minutes * 60.0 if args.minutes is not None else math.inf
    t0 = time.time()
    last_eval, step, curve = t0, 0, []
    model.train()
    while True:
        elapsed = time.time() - t0
        progress = step / args.steps if args.steps is not None else elapsed / budget_s
        if progress >= 1.0:
            break
        lr = lr_at(args, step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train_ids) - span, size=args.batch)
        chunk = torch.from_numpy(np.stack([train_ids[s : s + span] for s in starts]))
        loss, main, mtp = joint_loss(model, chunk, args.mtp_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        balancer.step()
        step += 1
        if step % args.log_every == 0:
            tps = step * args.batch * args.seq / (time.time() - t0)
            print(
                f"step {step} t {time.time() - t0:.0f}s lr {lr:.2e} loss {float(main.detach()):.3f} "
                f"mtp {float(mtp.detach()):.3f} gnorm {float(gnorm):.2f} tok/s {tps:.0f}",
                flush=True,
            )
        if time.time() - last_eval >= args.eval_every_s:
            last_eval = time.time()
            vm, vt = quick_val(model, val_ids, args.seq, args.eval_windows)
            curve.append({"t_s": round(last_eval - t0), "step": step, "val_main": vm, "val_mtp": vt})
            print(f"VAL step {step} t {last_eval - t0:.0f}s main {vm:.4f} mtp {vt:.4f}", flush=True)
    wall = time.time() - t0
    return {
        "steps": step,
        "tokens_seen": step * args.batch * args.seq,
        "train_wall_s": round(wall, 1),
        "tokens_per_s": round(step * args.batch * args.seq / max(wall, 1e-9), 1),
        "val_curve_partial": curve,
    }


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
    with open(os.path.join(args.out, "training_info.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    print(f"saved {args.out} after {info['steps']} steps, {info['tokens_seen']} tokens", flush=True)

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
