"""Weight streaming: a helper thread that pulls the weights a fused MoE call is about to read
into the shared last-level cache, on a core the engine leaves idle (csrc/weight_stream.h;
docs/cpu_kernels.md, "Weight streaming").

On one thread a prefill-sized MoE call alternates between waiting for an expert's weights
and multiplying them; the helper, running at SCHED_IDLE on the front end's core, reads the
next experts while the compute thread multiplies and demotes each line (CLDEMOTE) to the
shared cache, where the compute thread then finds it. Whether it pays is measured per
machine where an engine starts (engine/engine_core.py, ParallelConfig.weight_streaming).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from wideserve.kernels.loader import cpu_flags
from wideserve.utils.cpu_cache import last_level_cache_bytes

DEFAULT_LEAD_BYTES = 32 << 20      # the most the helper reads ahead of the compute thread
MIN_PLAN_BYTES = 4 << 20           # calls reading less (what L2 holds) are not streamed


@dataclass(frozen=True, slots=True)
class StreamStats:
    running: bool
    plans: int          # calls that posted their weights
    ranges: int         # weight ranges the helper read whole
    bytes: int          # ... and their bytes
    sched_idle: bool    # the helper runs at SCHED_IDLE
    pinned: bool        # the helper is bound to the CPUs it was given


def demotes() -> bool:
    """Whether the CPU demotes lines to the shared cache (CLDEMOTE; elsewhere the helper's
    reads would stay in its own core's cache)."""
    return "cldemote" in cpu_flags()


def lead_bytes() -> int:
    """How far ahead the helper reads: DEFAULT_LEAD_BYTES, at most a quarter of the
    last-level cache where the OS reports its size."""
    llc = last_level_cache_bytes()
    return min(DEFAULT_LEAD_BYTES, llc // 4) if llc > 0 else DEFAULT_LEAD_BYTES


def start(cpus: Sequence[int] = (), lead: int | None = None,
          min_plan: int | None = None, idle: bool = True) -> bool:
    """Start this process's helper, bound to `cpus` (() = not bound), reading at most `lead`
    bytes ahead (lead_bytes()), for calls of at least `min_plan` bytes (MIN_PLAN_BYTES), at
    SCHED_IDLE (`idle=False`: the normal policy, for a helper with a core of its own, and for
    tests on a busy machine, where an idle-policy thread may not run at all); False when
    one runs already."""
    return bool(torch.ops.wideserve.weight_stream_start(
        list(cpus), lead if lead is not None else lead_bytes(),
        min_plan if min_plan is not None else MIN_PLAN_BYTES, idle))


def stop() -> None:
    """Stop the helper (a no-op when none runs); ops called afterwards do not stream."""
    torch.ops.wideserve.weight_stream_stop()


def active() -> bool:
    """Whether this process's helper runs (a cheap check, once per forward)."""
    return bool(torch.ops.wideserve.weight_stream_active())


def queue(tensors: Sequence[torch.Tensor]) -> None:
    """Stream `tensors` (contiguous, CPU) after the next MoE call's experts: what runs after
    that call (a no-op without a helper)."""
    torch.ops.wideserve.weight_stream_queue(list(tensors))


def stats() -> StreamStats:
    running, plans, ranges, nbytes, idle, pinned = torch.ops.wideserve.weight_stream_stats()
    return StreamStats(bool(running), plans, ranges, nbytes, bool(idle), bool(pinned))
