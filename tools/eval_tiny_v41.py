"""Model-card numbers of the bundled tiny DeepSeek-V4.1, computed from the saved directory alone.

    .venv/bin/python tools/eval_tiny_v41.py wideserve/assets/shakespeare-v41-tiny [--write-card]

Protocol (the bundled V4's, tools/eval_tiny.py, plus the drafter):
- weights: the bf16 tensors of model.safetensors upcast to fp32, all compute in fp32, in the
  reference implementation (nemo-automodel 0.7.0, tools/tiny_v41.py) with its KV quantisers on.
- held-out tokens and windows: as the V4's (tools/tiny_data.py's stream, last 5%); window i
  feeds tokens [256 i, 256 i + 256) at positions 0..255 with a fresh context and is scored on
  the next tokens. Val loss = mean CE over all W x 256 targets; perplexity = exp(val loss).
  `val_loss_first16` is the same over the first 16 windows (the engine test's cheap check).
- DSpark: in the first 64 windows (`dspark_windows`: 16,064 blocks), one block per anchor
  a = 1..251 (context = the target's tap features at [a - 64, a)); slot j drafts a + 1 + j.
  * teacher-forced (the training objective's view: the Markov head reads the true previous
    token): per-slot CE against the text, acceptance at temperature 1 = 1 - TV(draft, target)
    with the target's distribution at the same position, tau_t1 = 1 + sum_j prod_{i<=j} accept_i
    (expected tokens per verified block at T = 1), the confidence head's mean prediction.
  * chained (the serving view: slot j's Markov input is the slot j-1 draft): per-slot top-1 =
    the text token, and = the target's top-1 at the same position given the true prefix.
- expert load: routed picks per expert over every window (backbone layers and DSpark stages).
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_data import held_out_stream, held_out_windows  # noqa: E402
from tiny_v41 import TinyV41, load_model, routers  # noqa: E402

WINDOW = 256
BLOCK = 5
SAMPLE_PROMPTS = ("Romeo.\n", "King Henry.\nMy lord,")


def _load_counters(model: TinyV41) -> dict[str, torch.Tensor]:
    counts: dict[str, torch.Tensor] = {}
    for name, gate in routers(model):
        key = name.removeprefix("lm.").removeprefix("draft.").removesuffix(".ffn.gate")
        counts[key] = torch.zeros(gate.n_experts)

        def hook(module, _args, out, key=key):  # noqa: ANN001
            counts[key] += torch.bincount(out[1].reshape(-1), minlength=module.n_experts).float()

        gate.register_forward_hook(hook)
    return counts


class _Sums:
    """Running sums of the per-slot DSpark metrics."""

    def __init__(self) -> None:
        self.ce = torch.zeros(BLOCK, dtype=torch.float64)
        self.accept = torch.zeros(BLOCK, dtype=torch.float64)
        self.conf = torch.zeros(BLOCK, dtype=torch.float64)
        self.top1_text = torch.zeros(BLOCK, dtype=torch.float64)
        self.top1_target = torch.zeros(BLOCK, dtype=torch.float64)
        self.tau = 0.0
        self.blocks = 0

    def result(self) -> dict:
        n = max(self.blocks, 1)
        r = lambda t: [round(float(v) / n, 4) for v in t]  # noqa: E731
        return {"dspark_blocks": self.blocks, "dspark_ce_per_slot": r(self.ce),
                "dspark_accept_t1_per_slot": r(self.accept), "dspark_tau_t1": round(self.tau / n, 4),
                "dspark_confidence_per_slot": r(self.conf),
                "dspark_top1_text_per_slot": r(self.top1_text),
                "dspark_top1_target_per_slot": r(self.top1_target)}


def _dspark_window_metrics(model: TinyV41, chunk: torch.Tensor, feats: torch.Tensor,
                           target_logits: torch.Tensor, sums: _Sums) -> None:
    """chunk [b, 257] tokens, feats [b, 256, 3d] tap features, target_logits [b, 256, V]."""
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone
    d = model.draft
    b = chunk.shape[0]
    anchors = torch.arange(1, WINDOW - BLOCK + 1).expand(b, -1)                   # [b, A]
    A = anchors.shape[1]
    offs = torch.arange(BLOCK)
    labels = torch.gather(chunk, 1, (anchors[..., None] + 1 + offs).reshape(b, -1)).view(b, A, BLOCK)
    first = torch.gather(chunk, 1, anchors)                                          # [b, A]
    noise = torch.full((b, A, BLOCK), d.config.dspark_noise_token_id)
    noise[..., 0] = first
    keep = torch.ones(b, A, dtype=torch.bool)
    out = DeepseekV41DSparkBackbone.forward(
        d, d.embed_tokens(noise.view(b, -1)), feats,
        position_ids=d.build_position_ids(anchors, WINDOW),
        attention_mask=d.build_attention_mask(anchors, keep, WINDOW, torch.float32),
        previous_token_ids=torch.cat([first[..., None], labels[..., :-1]], -1).view(b, -1))
    states = out.normalized_hidden_states.view(b, A, BLOCK, -1)
    draft = (d.compute_logits(out.normalized_hidden_states) + out.transition_logits.float()).view(b, A, BLOCK, -1)
    tgt = torch.gather(target_logits, 1, (anchors[..., None] + offs).reshape(b, -1, 1)
                       .expand(-1, -1, target_logits.shape[-1])).view(b, A, BLOCK, -1)
    ce = F.cross_entropy(draft.reshape(-1, draft.shape[-1]), labels.reshape(-1), reduction="none")
    accept = 1 - 0.5 * (draft.softmax(-1) - tgt.softmax(-1)).abs().sum(-1)             # [b, A, B]
    sums.ce += ce.view(b, A, BLOCK).sum((0, 1)).double()
    sums.accept += accept.sum((0, 1)).double()
    sums.tau += float((1 + accept.cumprod(-1).sum(-1)).sum())
    sums.conf += torch.sigmoid(out.confidence_pred.float()).view(b, A, BLOCK).sum((0, 1)).double()
    sums.blocks += b * A
    # chained: the Markov head reads the previous draft, as the engine's proposer does
    head = d.mtp[-1].markov_head
    prev = first
    for j in range(BLOCK):
        trans, _ = head(prev)
        logits = d.compute_logits(states[:, :, j]) + trans.float()
        prev = logits.argmax(-1)
        sums.top1_text[j] += float((prev == labels[..., j]).sum())
        sums.top1_target[j] += float((prev == tgt[:, :, j].argmax(-1)).sum())


@torch.no_grad()
def evaluate(model_dir: str, limit_bytes: int | None = None, max_windows: int | None = None,
             batch: int = 4, sample_tokens: int = 60, dspark_windows: int = 64) -> dict:
    model = load_model(model_dir)
    val = held_out_stream(model_dir, limit_bytes)
    n_win = held_out_windows(val, WINDOW, max_windows)
    counts = _load_counters(model)
    nll = torch.zeros(n_win, dtype=torch.float64)
    sums = _Sums()
    for b0 in range(0, n_win, batch):
        idx = range(b0, min(b0 + batch, n_win))
        chunk = torch.from_numpy(np.stack([val[i * WINDOW: i * WINDOW + WINDOW + 1] for i in idx]))
        model._taps.clear()
        out = model.lm(chunk[:, :-1])
        logits = out.logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="none")
        nll[b0:b0 + len(idx)] = ce.view(len(idx), -1).sum(1).double()
        if b0 < dspark_windows:     # the drafter's metrics cost 6x the target's forward
            keep = min(len(idx), dspark_windows - b0)
            _dspark_window_metrics(model, chunk[:keep], torch.cat(model._taps, -1)[:keep],
                                   logits[:keep], sums)
    val_loss = float(nll.sum()) / (n_win * WINDOW)
    first = min(16, n_win)
    loads = {k: {"max_over_mean": round(float(c.max() / c.mean()), 3), "counts": [int(v) for v in c]}
             for k, c in counts.items()}
    return {"windows": n_win, "targets": n_win * WINDOW, "val_loss": round(val_loss, 4),
            "val_ppl": round(math.exp(val_loss), 2),
            "val_loss_first16": round(float(nll[:first].sum()) / (first * WINDOW), 4),
            "dspark_windows": min(dspark_windows, n_win), **sums.result(), "expert_load": loads,
            "samples": samples(model, model_dir, sample_tokens)}


@torch.no_grad()
def samples(model: TinyV41, model_dir: str, new_tokens: int = 60) -> list[dict]:
    """Greedy and temperature-0.8 (seed 0) continuations; the reference has no KV cache, so
    each token re-runs the whole sequence."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = [0, *tok.encode(prompt, add_special_tokens=False).ids]
        for mode, temp in (("greedy", 0.0), ("t=0.8", 0.8)):
            g = torch.Generator().manual_seed(0)
            seq = list(ids)
            for _ in range(new_tokens):
                logits = model.lm(torch.tensor([seq])).logits[0, -1].float()
                if temp == 0.0:
                    seq.append(int(logits.argmax()))
                else:
                    seq.append(int(torch.multinomial((logits / temp).softmax(-1), 1, generator=g)))
            out.append({"prompt": prompt, "mode": mode, "text": tok.decode(seq[len(ids):])})
    return out


def write_card(model_dir: str, info: dict, metrics: dict) -> None:
    from card_tiny_v41 import render_card  # the long markdown lives in its own file

    with open(os.path.join(model_dir, "eval_results.json"), "w") as f:
        json.dump(metrics, f, indent=2)
        f.write("\n")
    with open(os.path.join(model_dir, "README.md"), "w") as f:
        f.write(render_card(model_dir, info, metrics))


def main(argv: list[str] | None = None) -> None:
    import eval_tiny   # the same CLI as the V4's
    eval_tiny.main(argv, evaluate, write_card, __doc__)


if __name__ == "__main__":
    main()
