"""What the tiny-model trainers share (tools/train_tiny.py for V4 + MTP, tools/train_tiny_v41.py
for V4.1 + DSpark): the common flags, the learning-rate schedule, the optimizer groups, the
aux-loss-free router balancing and the training loop itself. Each trainer supplies its model's
loss and held-out check as a `TrainHooks`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The flags every tiny-model trainer has."""
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


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, no weight decay on vectors (norms, biases)."""
    train = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in train if p.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in train if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


@dataclass
class TrainHooks:
    """The model-specific parts of a training run."""
    # chunk [batch, span] -> (loss to minimise, the log line's loss fields)
    loss: Callable[[torch.Tensor], tuple[torch.Tensor, str]]
    validate: Callable[[], dict[str, float]]   # held-out numbers for the training curve
    balancer: RouterBalancer
    save: Callable[[], None] | None = None     # intermediate saves every args.save_every_s


def train_loop(model: torch.nn.Module, train_ids: np.ndarray, span: int, args: argparse.Namespace,
               hooks: TrainHooks) -> dict:
    """Steps until args.steps or args.minutes; returns the run's numbers and partial val curve."""
    if len(train_ids) <= span:
        raise ValueError(f"training stream has {len(train_ids)} tokens, need more than {span}")
    opt = make_optimizer(model, args)
    params = [p for p in model.parameters() if p.requires_grad]
    rng = np.random.default_rng(args.seed)
    budget_s = args.minutes * 60.0 if args.minutes is not None else math.inf
    save_every_s = getattr(args, "save_every_s", math.inf)
    t0 = time.time()
    last_eval = last_save = t0
    step, curve = 0, []
    model.train()
    while True:
        progress = step / args.steps if args.steps is not None else (time.time() - t0) / budget_s
        if progress >= 1.0:
            break
        lr = lr_at(args, step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train_ids) - span, size=args.batch)
        chunk = torch.from_numpy(np.stack([train_ids[s: s + span] for s in starts]))
        loss, fields = hooks.loss(chunk)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        hooks.balancer.step()
        step += 1
        if step % args.log_every == 0:
            tps = step * args.batch * args.seq / (time.time() - t0)
            print(f"step {step} t {time.time() - t0:.0f}s lr {lr:.2e} {fields} gnorm {float(gnorm):.2f} "
                  f"tok/s {tps:.0f}", flush=True)
        if time.time() - last_eval >= args.eval_every_s:
            last_eval = time.time()
            v = hooks.validate()
            curve.append({"t_s": round(last_eval - t0), "step": step, **v})
            print(f"VAL step {step} t {last_eval - t0:.0f}s {v}", flush=True)
        if hooks.save is not None and time.time() - last_save >= save_every_s:
            last_save = time.time()
            hooks.save()
    wall = time.time() - t0
    return {"steps": step, "tokens_seen": step * args.batch * args.seq,
            "train_wall_s": round(wall, 1),
            "tokens_per_s": round(step * args.batch * args.seq / max(wall, 1e-9), 1),
            "val_curve_partial": curve}


def write_training_info(out_dir: str, info: dict) -> None:
    with open(os.path.join(out_dir, "training_info.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    print(f"saved {out_dir} after {info['steps']} steps, {info['tokens_seen']} tokens", flush=True)
