"""Prefill instances and the KV transfer to decode (P/D disaggregation).

Prefill: an instance of `ranks` GPUs runs prompts one after another (FIFO); a prompt of n
new tokens costs a forward over n tokens: 2 * active parameters * n FLOPs at peak, or the
weights' read time if larger (roofline; prompts are compute-bound), plus attention over the
cached prefix. KV of a request: context * KV bytes/token + the bounded windows (the model's
own KV spec). Transfer over the NIC (or NVLink inside a domain):
  pull:        one read per block per cache: ceil(ctx / block) * caches transfers
  packed push: the prefill packs the blocks of each cache into one write: `caches` transfers
  time = transfers * (per-transfer overhead + latency) + bytes / bandwidth
On a calibrated machine the prefill is the measured one-rank table, the link is the measured
NIXL path (its per-transfer time already holds the software overhead), and admitting a load
costs the decode host the measured admission time at the request's context (calibrate_pd.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from wideserve.sim.costs import interp
from wideserve.sim.hardware import Hardware, Profile
from wideserve.sim.model import FORMAT_BYTES, ModelShape


@dataclass(slots=True)
class PDSettings:
    prefill_instances: int = 0      # 0: colocated (prefill inside the decode steps)
    prefill_ranks: int = 4          # GPUs per prefill instance
    transfer: str = "push"          # "pull" (per block) or "push" (packed)
    transfer_overhead_s: float | None = None    # None: 20 us on a GPU, 0 when measured
    block_size: int = 256
    caches: int = 4                 # KV caches moved per request (owned specs)
    max_kv_loads_per_step: int | None = None
    prefill_batch_tokens: int = 0   # prompts batched per prefill step (0: one at a time)
    # The deployment's instances share one host of this many cores (a P/D pair on one
    # machine, as the held-out validation runs it); 0: each instance on its own host.
    # Measured hardware only: shared_host_factor.
    host_cores: int = 0


def shared_host_factor(cores: int, resident: int, others: float) -> float:
    """How much longer a compute phase takes while `others` more compute threads are
    runnable on a host of `cores` cores, against its calibration beside `resident`
    always-runnable threads (itself included: the engine thread plus the idle NIXL agents'
    polling threads it was measured beside). The OS shares the cores fairly between
    runnable threads (Linux CFS), so a thread runs min(1, cores / runnable) of the time:
    factor = min(1, C / R) / min(1, C / (R + others)). 1 when the host has a core to spare
    (2 cores, the engine alone and one other); no constant fitted to a measurement."""
    if cores <= 0 or others <= 0:
        return 1.0
    resident = max(resident, 1)
    return min(1.0, cores / resident) / min(1.0, cores / (resident + others))


def kv_bytes(m: ModelShape, context: int) -> float:
    return context * m.kv_bytes_per_token + m.kv_bounded_bytes


def transfer_s(m: ModelShape, hw: Hardware, pd: PDSettings, context: int) -> float:
    if pd.transfer not in ("pull", "push"):
        raise ValueError(f"KV transfer must be pull or push, got {pd.transfer!r}")
    blocks = math.ceil(context / pd.block_size)
    transfers = blocks * pd.caches if pd.transfer == "pull" else pd.caches
    overhead = pd.transfer_overhead_s
    if overhead is None:
        overhead = 0.0 if hw.kind == "measured" else 20e-6
    return transfers * (overhead + hw.nic_latency_s) \
        + kv_bytes(m, context) / hw.nic_bytes_per_s


def prefill_s(m: ModelShape, hw: Hardware, new_tokens: int, cached: int, ranks: int,
              table: dict | None = None) -> float:
    """One prompt on one prefill instance of `ranks` GPUs (tensor/expert parallel, ideal split);
    `table`: the measured one-rank prefill seconds vs prompt tokens (a calibrated machine)."""
    if table:
        return interp(table["tokens"], table["s"], new_tokens) / ranks
    active = m.dense_params + m.expert_params * m.top_k / max(1, m.experts)
    flops = 2 * active * new_tokens
    attn = 4 * m.heads * m.head_dim * new_tokens * (cached + new_tokens / 2) * m.layers \
        * _attended_fraction(m, cached + new_tokens)
    weights = m.dense_bytes + m.expert_params * FORMAT_BYTES[m.expert_format]
    return max((flops + attn) / (hw.peak(m.expert_format) * ranks),
               weights / (hw.mem_bytes_per_s * ranks))


def _attended_fraction(m: ModelShape, ctx: int) -> float:
    """Share of the context a query attends (compressed sparse attention reads far less)."""
    if ctx <= 0:
        return 0.0
    read = sum((a.window + a.entries(ctx)) if a.window or a.topk else ctx for a in m.attn)
    return min(1.0, read / (len(m.attn) * ctx))


def admission_s(profile: Profile, hw: Hardware, context: float) -> float:
    """Decode-host seconds to admit one KV load of `context` tokens: the measured admission
    table (lookup + allocate + plan), scaled by the host speed; a flat `per_kv_load_s` in the
    profile's host costs otherwise; 0 when neither was measured."""
    table = profile.pd.get("admission")
    if table:
        return interp(table["tokens"], table["s"], context) / hw.host_speed
    return profile.host.get("per_kv_load_s", 0.0) / hw.host_speed
