"""The prefill cap a server measures at start (SchedulerConfig.max_prefill_tokens "auto";
engine/scheduler.py and docs/design.md, "Prefill cap").

A burst of prompts that fills the step budget W and is split over s steps of P = W / s prompt
tokens returns the first tokens of its i-th slice after i steps: on average after
t(P) (s + 1) / 2, against t(W) when the whole burst is one step (t: the step time of a fresh
prefill of that many tokens, measured here on the model as loaded, on the engine's threads).
Where a step is bound by streaming its weights, t(P) hardly grows with P and splitting only
adds steps; where it is bound by its arithmetic, t(P) ~ P and a split returns most first
tokens sooner. The cap is the largest P whose mean wait is within `NEAR` of the least, when
that least is at least `MARGIN` below t(W) (else 0: no cap), so noise in the timings neither
splits a burst for nothing nor picks more steps for a gain it cannot tell apart.

What it costs is the burst's own total time, t(P) s against t(W) (more steps, each reading
the weights), and, once bursts no longer arrive together, prompt tokens in other requests'
decode steps: BENCHMARKS.md, "Prefill cap", has both measured.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.worker.memory_profile import timed_prefill

SPLITS = (1, 2, 4, 8)    # a budget-filling burst over this many steps
MIN_CAP = 64             # no slice below this many tokens (a step's fixed costs dominate)
PROMPT_TOKENS = 256      # the timed steps' prompts (their attention is a small share)
MARGIN = 0.9             # a split must cut the mean wait by 10% or more
NEAR = 1.05              # slices this close to the best mean wait count as as good
REPEATS = 2              # timings per size, the least kept (the first may pack or plan)


def cap_sizes(budget: int) -> list[int]:
    """The prompt tokens per step timed for a budget of `budget`: W, W/2, W/4, W/8."""
    return [budget // s for s in SPLITS if budget // s >= MIN_CAP or s == 1]


def choose_cap(times: dict[int, float], budget: int, margin: float = MARGIN,
               near: float = NEAR) -> int:
    """The cap (0: none) from step seconds per prompt tokens (0 where the budget itself was
    not timed). Of the slices whose mean wait is within `near` of the least, the largest
    (fewer steps: less of the burst's time spent re-reading weights, fewer prompt tokens in
    decode steps)."""
    if budget not in times:
        return 0
    whole = times[budget]
    waits = {tokens: t * (budget / tokens + 1) / 2 for tokens, t in times.items()
             if tokens < budget}
    if not waits or min(waits.values()) > margin * whole:
        return 0
    best = min(waits.values())
    return max(tokens for tokens, w in waits.items() if w <= near * best)


def prompt_lengths(tokens: int, sched: SchedulerConfig, max_model_len: int) -> list[int]:
    """`tokens` as fresh prompts of about PROMPT_TOKENS each, within max_num_seqs requests
    and max_model_len positions ([] where they do not fit)."""
    longest = max(1, max_model_len - 1)
    n = max(math.ceil(tokens / min(PROMPT_TOKENS, longest)), 1)
    if n > sched.max_num_seqs or math.ceil(tokens / n) > longest:
        return []
    base, extra = divmod(tokens, n)
    return [base + (i < extra) for i in range(n)]


def measure(model: Any, specs: dict, cache: CacheConfig, sched: SchedulerConfig,
            max_model_len: int, device: torch.device, vocab: int) -> dict[int, float]:
    """Step seconds of a fresh prefill per prompt tokens (cap_sizes of the budget; sizes the
    limits cannot hold are left out), each the least of REPEATS throwaway steps of random
    tokens below `vocab` (a MoE's routing spreads them as it does a real prompt's; one token
    repeated would reach only top-k experts) that sample the last row of each prompt only."""
    times: dict[int, float] = {}
    for tokens in cap_sizes(sched.max_num_batched_tokens):
        lengths = prompt_lengths(tokens, sched, max_model_len)
        if lengths:
            times[tokens] = min(timed_prefill(model, specs, cache, sched, max_model_len,
                                              device, lengths, vocab)
                                for _ in range(REPEATS))
    return times
