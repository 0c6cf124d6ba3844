"""`wideserve info MODEL --plan`: how much memory a deployment needs, from config.json alone.

The model is built on the meta device (no weights read), so a 284B checkpoint directory that
holds only its config can be sized. Per rank: the weights as wideserve holds them (FP8/FP4
checkpoints are dequantised to the load dtype; V4.1's Engram tables stay FP8 in host memory),
the routed experts split over the ranks under expert parallelism, and what is left of a given
memory size for the KV cache, in tokens and in requests at the full context.

An estimate from shapes: activations, the captured decode step and the runtime's own memory
are not counted (the server's memory profile measures them on CUDA, docs/memory.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from wideserve.layers.engram import HostResident

GIB = 1 << 30
# V4.1's Engram tables are kept FP8 with one UE8M0 scale per 32 values (models/deepseek_v41.py
# keeps_quantised): 1 + 1/32 bytes per value.
FP8_WITH_SCALES = 1 + 1 / 32
DEP_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(slots=True)
class WeightBytes:
    experts: int          # routed experts, sharded under expert parallelism
    rest: int             # everything else, a full copy on every rank
    host: int             # host-resident tables (a copy per node in host memory)

    def per_rank(self, ranks: int, expert_parallel: bool) -> float:
        return self.rest + (self.experts / ranks if expert_parallel else self.experts)


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Bytes of the parameters as loaded, from a model built on the meta device."""
    host_modules = {name for name, m in model.named_modules()
                    if isinstance(m, HostResident)}
    keeps = model.keeps_quantised
    experts = rest = host = 0
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if module in host_modules:
            per_value = FP8_WITH_SCALES if keeps(name) \
                else p.element_size()
            host += int(p.numel() * per_value)
        elif ".experts." in name:
            experts += p.numel() * p.element_size()
        else:
            rest += p.numel() * p.element_size()
    return WeightBytes(experts, rest, host)


@dataclass(slots=True)
class PlanInputs:
    ranks: int
    expert_parallel: bool
    memory_per_rank: int | None      # bytes of device memory per rank; None = not given
    utilization: float               # the fraction of it wideserve may use
    max_model_len: int
    max_num_seqs: int


def _gib(n: float) -> str:
    """GiB, or MiB below one GiB (a bounded window of a few MiB is not "0.01 GiB")."""
    return f"{n / GIB:,.2f} GiB" if n >= GIB or n == 0 else f"{n / (1 << 20):,.2f} MiB"


def plan_lines(w: WeightBytes, kv_per_token: float, kv_bounded: int, p: PlanInputs,
               dtype: str, kv_dtype: str) -> list[str]:
    layout = (f"DEP over {p.ranks} ranks (experts sharded)" if p.expert_parallel and p.ranks > 1
              else f"{p.ranks} data-parallel ranks, a full copy each" if p.ranks > 1
              else "one rank")
    per_rank = w.per_rank(p.ranks, p.expert_parallel)
    per_request = kv_bounded + kv_per_token * p.max_model_len
    lines = [f"plan: {layout}; {dtype} weights, KV --kv-cache-dtype {kv_dtype}, "
             f"max_model_len {p.max_model_len:,}",
             "  (estimated from shapes: activations and runtime memory not included; keep "
             "~10% aside)",
             f"  weights per rank:   {_gib(per_rank)} = routed experts "
             f"{_gib(w.experts / p.ranks if p.expert_parallel else w.experts)}"
             f"{f' (1/{p.ranks} of {_gib(w.experts)})' if p.expert_parallel else ''}"
             f" + the rest {_gib(w.rest)}"]
    if w.host:
        lines.append(f"  host memory:        {_gib(w.host)} of Engram tables (FP8, in host RAM, "
                     "not device memory)")
    lines.append(f"  KV per request:     {kv_per_token:,.0f} B/token + {_gib(kv_bounded)} "
                 f"bounded = {_gib(per_request)} at {p.max_model_len:,} tokens")
    if p.memory_per_rank is None:
        lines.append("  (--memory-per-rank 141GiB adds the KV capacity each rank is left with)")
    else:
        lines += _capacity_lines(per_rank, kv_per_token, kv_bounded, per_request, p)
    lines += ["", "  weights per rank by layout (GiB):",
              "    ranks " + "".join(f"{n:>9d}" for n in DEP_SIZES),
              "    DEP   " + "".join(f"{w.per_rank(n, True) / GIB:>9.1f}" for n in DEP_SIZES),
              f"    (without expert parallelism every rank holds all {_gib(w.per_rank(1, False))})"]
    if p.memory_per_rank is not None:
        lines.append(_min_ranks_line(w, p))
    return lines


def _capacity_lines(per_rank: float, kv_per_token: float, kv_bounded: int,
                    per_request: float, p: PlanInputs) -> list[str]:
    usable = p.memory_per_rank * p.utilization
    left = usable - per_rank - kv_bounded * p.max_num_seqs
    head = (f"  with {_gib(p.memory_per_rank)} per rank x {p.utilization:g}: "
            f"{_gib(usable)} - weights {_gib(per_rank)} - windows of {p.max_num_seqs} "
            f"requests {_gib(kv_bounded * p.max_num_seqs)} = {_gib(max(left, 0))} for KV")
    if left <= 0:
        return [head, "  DOES NOT FIT: add ranks (--data-parallel-size with "
                      "--enable-expert-parallel) or memory"]
    tokens = int(left // kv_per_token) if kv_per_token else 0
    full = int(left // per_request) if per_request else 0
    fits = "" if full >= 1 else " (NOT ONE full-context request: lower --max-model-len)"
    return [head,
            f"  KV capacity:        {tokens:,} tokens of context per rank, shared by its "
            f"running requests = {full:,} requests at {p.max_model_len:,} tokens{fits}"]


def _min_ranks_line(w: WeightBytes, p: PlanInputs) -> str:
    usable = p.memory_per_rank * p.utilization
    if usable <= w.rest:
        return (f"  the non-expert weights alone ({_gib(w.rest)}) exceed "
                f"{_gib(usable)}: no DEP size fits")
    n = max(1, math.ceil(w.experts / (usable - w.rest)))
    return (f"  fewest DEP ranks for the weights alone: {n} (then little room for KV; "
            f"the KV capacity above is for {p.ranks})")
