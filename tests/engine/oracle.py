"""Reference greedy generations from transformers, and checkpoint dirs wideserve loads."""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch


def save_hf(model, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path, safe_serialization=True)
    return path


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int,
              context=contextlib.nullcontext) -> list[list[int]]:
    """Greedy continuation of each prompt (batch 1: no padding), ignoring EOS."""
    outs = []
    for p in prompts:
        with context(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                                                               dtype=torch.long),
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return outs


def mixed_prompts(vocab: int, lengths: list[int], seed: int, shared_prefix: int = 0
                  ) -> list[list[int]]:
    """Random prompts; with shared_prefix > 0 they all start with the same tokens."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, vocab, (shared_prefix,), generator=gen).tolist()
    return [prefix + torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]
