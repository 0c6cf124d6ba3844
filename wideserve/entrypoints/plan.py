"""`wideserve info MODEL --plan`: how much memory a deployment needs, from config.json alone.

The model is built on the meta device (no weights read), so a 284B checkpoint directory that
holds only its config can be sized. Per rank: the weights as wideserve holds them (routed
experts in the checkpoint's FP8 / FP4 / NVFP4 format where config.json names it, or naming
none, the family's released format (V4.1: MXFP4), as the loader keeps them,
worker/weights.py `keeps_expert_format`; other FP8 weights dequantised to the load
dtype; V4.1's Engram tables stay FP8 in host memory), split into the target and
its drafter (MTP / DSpark blocks), the routed experts split over the ranks under expert
parallelism plus EPLB's redundant replicas, the KV cache as the engine lays it out
(kv_cache/groups.py: pages padded to their bucket), an activation reserve estimated from
shapes, and what is left of a given memory size for the KV cache, in tokens and in requests at
the full context.

An estimate from shapes: the server's memory profile measures activations on CUDA
(docs/memory.md); the reserve here is for buying hardware, not for sizing the cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from wideserve.layers.engram import HostResident

GIB = 1 << 30
# V4.1's Engram tables are kept FP8 with one UE8M0 scale per 32 values (models/deepseek_v41/model.py
# keeps_quantised): 1 + 1/32 bytes per value.
FP8_WITH_SCALES = 1 + 1 / 32
# Checkpoint formats of routed experts, bytes per weight value with their scales
# (docs/deepseek_v4.md, layers/quant.py ExpertFormat): FP8 e4m3 with one scale per 128x128
# block (UE8M0; HF FP8's fp32 scales add 3 B per block, 0.0002 B/value); MXFP4 (two e2m1
# codes per byte) with one UE8M0 scale per 32 values; NVFP4 with one E4M3 scale per 16 (and an
# fp32 global per expert projection, negligible).
CHECKPOINT_EXPERT_BYTES = {"fp8": 1 + 1 / (128 * 128), "fp4": 0.5 + 1 / 32,
                           "nvfp4": 0.5 + 1 / 16}
DEP_SIZES = (1, 2, 4, 8, 16, 32, 64)
DRAFT_PREFIXES = ("mtp.", "model.mtp.")


@dataclass(slots=True)
class WeightBytes:
    experts: int          # routed experts (target + draft), sharded under expert parallelism
    rest: int             # everything else, a full copy on every rank
    host: int             # host-resident tables (a copy per node in host memory)
    draft: int = 0        # the drafter's share of experts + rest (MTP / DSpark blocks)
    draft_experts: int = 0
    one_expert: float = 0.0    # bytes of one routed expert summed over the MoE layers
    expert_values: int = 0     # routed-expert weight values (for checkpoint-format bytes)

    def per_rank(self, ranks: int, expert_parallel: bool, redundant: int = 0) -> float:
        """Device bytes of one rank; `redundant` EPLB replicas per MoE layer, over all ranks."""
        if not expert_parallel:
            return self.rest + self.experts
        return self.rest + (self.experts + redundant * self.one_expert) / ranks

    def experts_as(self, fmt: str) -> float:
        """All routed experts' bytes if held in checkpoint format `fmt` (fp8 / fp4)."""
        return self.expert_values * CHECKPOINT_EXPERT_BYTES[fmt]

    def with_experts_as(self, fmt: str) -> WeightBytes:
        """The same weights with the routed experts held in checkpoint format `fmt` (as the
        loader keeps them, layers/experts.py `keep_checkpoint_format`)."""
        ratio = self.experts_as(fmt) / self.experts if self.experts else 1.0
        draft_experts = int(self.draft_experts * ratio)
        return WeightBytes(int(self.experts * ratio), self.rest, self.host,
                           self.draft - self.draft_experts + draft_experts, draft_experts,
                           self.one_expert * ratio, self.expert_values)


def _is_draft(name: str) -> bool:
    return name.startswith(DRAFT_PREFIXES)


def host_resident_modules(model: nn.Module) -> set[str]:
    """Names of the modules whose parameters the loader keeps in host memory."""
    return {name for name, m in model.named_modules() if isinstance(m, HostResident)}


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Bytes of the parameters as loaded, from a model built on the meta device (experts
    unsharded: the first dimension of an expert tensor is the layer's expert count)."""
    host_modules = host_resident_modules(model)
    keeps = model.keeps_quantised
    w = WeightBytes(0, 0, 0)
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        size = p.numel() * p.element_size()
        if module in host_modules:
            per_value = FP8_WITH_SCALES if keeps(name) \
                else p.element_size()
            w.host += int(p.numel() * per_value)
            continue
        if ".experts." in name:
            w.experts += size
            w.expert_values += p.numel()
            w.one_expert += size / p.shape[0]
            if _is_draft(name):
                w.draft_experts += size
        else:
            w.rest += size
        if _is_draft(name):
            w.draft += size
    return w


@dataclass(slots=True)
class PlanInputs:
    ranks: int
    expert_parallel: bool
    memory_per_rank: int | None      # bytes of device memory per rank; None = not given
    utilization: float               # the fraction of it wideserve may use
    max_model_len: int
    max_num_seqs: int
    num_redundant_experts: int = 0   # EPLB replicas per MoE layer, over all ranks
    reserve: int = 0                 # activation + decode-graph reserve per rank (estimate)
    checkpoint_experts: str | None = None   # the checkpoint's expert format, if config says
    format_assumed: bool = False     # config.json names none: the family's released format
    experts_kept: bool = False       # the weights hold the experts in that format (loader)
    dense_experts: float = 0.0       # all routed experts' bytes if dequantised to the load dtype


@dataclass(frozen=True, slots=True)
class ActivationShape:
    """What the activation estimate reads from a model config (absent fields: GQA models)."""
    hidden: int
    vocab: int
    heads: int
    top_k: int = 0
    moe_intermediate: int = 0
    streams: int = 1          # V4's hyper-connection residual streams (hc_mult)
    attended: int = 0         # keys one query reads: sparse top-k + window (V4), else 0


def activation_reserve(a: ActivationShape, tokens: int, seqs: int, dtype_bytes: int) -> int:
    """Peak activations of the largest step (`tokens` = --max-num-batched-tokens) plus the
    sampled rows' fp32 logits, from shapes: a buying estimate, not the profile run's number.
    Per token: the residual streams and ~6 hidden-sized temporaries of one layer, the routed
    rows (k copies in, out and the 2 x intermediate gate/up), fp32 attention scores of the
    attended keys (long contexts run in chunks; dense GQA is flash-style and adds none);
    a captured decode step reuses this pool (its batch is at most max_num_seqs tokens)."""
    per_token = (a.hidden * (a.streams * 2 + 6) * dtype_bytes
                 + a.top_k * (2 * a.hidden + 2 * a.moe_intermediate) * dtype_bytes
                 + a.heads * a.attended * 4)
    return tokens * per_token + 2 * seqs * a.vocab * 4


def activation_shape(config: object) -> ActivationShape:
    get = lambda *names, default=0: next(          # noqa: E731 - a local lookup helper
        (int(getattr(config, n)) for n in names if getattr(config, n, None)), default)
    topk_keys = get("index_topk")
    return ActivationShape(
        hidden=get("hidden_size"), vocab=get("vocab_size"), heads=get("num_attention_heads"),
        top_k=get("num_experts_per_tok"), moe_intermediate=get("moe_intermediate_size"),
        streams=get("hc_mult", default=1),
        attended=topk_keys + get("sliding_window") if topk_keys else 0)


def engine_kv_sizes(specs: dict, max_num_seqs: int, max_num_batched_tokens: int
                    ) -> tuple[float, float]:
    """(bytes per token of context, fixed bytes per running request) as the engine lays the
    cache out (kv_cache/groups.py): pages padded to their bucket's widest page; the fixed part
    is the sliding windows, compressor state, a step's prefill pages and the window pages kept
    for prefix hits, divided over `max_num_seqs` requests. Read off the engine's own sizing
    for a budget far larger than any device, so it is exact, not re-derived."""
    from wideserve.config import CacheConfig, SchedulerConfig
    from wideserve.kv_cache.groups import build_kv_cache_config
    sched = SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens)
    cfg = build_kv_cache_config(specs, CacheConfig(kv_cache_memory=1 << 60), sched)
    if cfg.capacity_tokens is None:              # only bounded caches: nothing grows
        return 0.0, cfg.total_bytes / max_num_seqs
    fixed = cfg.total_bytes - cfg.capacity_tokens * cfg.pool_bytes_per_token
    return cfg.pool_bytes_per_token, fixed / max_num_seqs


def _gib(n: float) -> str:
    """GiB, or MiB below one GiB (a bounded window of a few MiB is not "0.01 GiB")."""
    return f"{n / GIB:,.2f} GiB" if n >= GIB or n == 0 else f"{n / (1 << 20):,.2f} MiB"


def plan_lines(w: WeightBytes, kv_per_token: float, kv_bounded: int, p: PlanInputs,
               dtype: str, kv_dtype: str) -> list[str]:
    layout = (f"DEP over {p.ranks} ranks (experts sharded)" if p.expert_parallel and p.ranks > 1
              else f"{p.ranks} data-parallel ranks, a full copy each" if p.ranks > 1
              else "one rank")
    per_rank = w.per_rank(p.ranks, p.expert_parallel, p.num_redundant_experts)
    per_request = kv_bounded + kv_per_token * p.max_model_len
    lines = [f"plan: {layout}; {dtype} weights, KV --kv-cache-dtype {kv_dtype}, "
             f"max_model_len {p.max_model_len:,}",
             "  (estimated from shapes; the runtime's own memory (CUDA context, NCCL buffers) "
             "is not included: keep ~5% aside)",
             f"  weights per rank:   {_gib(per_rank)} = routed experts "
             f"{_gib(w.experts / p.ranks if p.expert_parallel else w.experts)}"
             f"{f' (1/{p.ranks} of {_gib(w.experts)})' if p.expert_parallel else ''}"
             f" + the rest {_gib(w.rest)}{_replica_note(w, p)}"]
    lines += _breakdown_lines(w, p, dtype)
    if w.host:
        lines.append(f"  host memory:        {_gib(w.host)} of Engram tables (FP8, in host RAM, "
                     "not device memory)")
    lines.append(f"  KV per request:     {kv_per_token:,.0f} B/token + {_gib(kv_bounded)} "
                 f"bounded = {_gib(per_request)} at {p.max_model_len:,} tokens")
    if p.reserve:
        lines.append(f"  activation reserve: {_gib(p.reserve)} (estimate: the largest prefill "
                     "step + sampled logits; the decode graph reuses it)")
    if p.memory_per_rank is None:
        lines.append("  (--memory-per-rank 141GiB adds the KV capacity each rank is left with)")
    else:
        lines += _capacity_lines(per_rank, kv_per_token, kv_bounded, per_request, p)
        if w.expert_values and not p.experts_kept:
            lines += _packed_capacity_lines(w, per_rank, kv_per_token, kv_bounded,
                                            per_request, p)
    lines += ["", "  weights per rank by layout (GiB):",
              "    ranks " + "".join(f"{n:>9d}" for n in DEP_SIZES),
              "    DEP   " + "".join(f"{w.per_rank(n, True) / GIB:>9.1f}" for n in DEP_SIZES),
              f"    (without expert parallelism every rank holds all {_gib(w.per_rank(1, False))})"]
    if p.memory_per_rank is not None:
        lines.append(_min_ranks_line(w, p))
    return lines


def _replica_note(w: WeightBytes, p: PlanInputs) -> str:
    if not (p.expert_parallel and p.num_redundant_experts):
        return ""
    return (f" + {p.num_redundant_experts} EPLB replicas "
            f"{_gib(p.num_redundant_experts * w.one_expert / p.ranks)}")


def _breakdown_lines(w: WeightBytes, p: PlanInputs, dtype: str) -> list[str]:
    """Target vs drafter, and the experts as loaded today vs in the checkpoint's format."""
    share = 1 / p.ranks if p.expert_parallel else 1.0
    lines = []
    if w.draft:
        draft = w.draft - w.draft_experts + w.draft_experts * share
        lines.append(f"    of which drafter (MTP / DSpark blocks): {_gib(draft)}; "
                     f"target {_gib(w.per_rank(p.ranks, p.expert_parallel) - draft)}"
                     f"{' (replicas apart)' if p.num_redundant_experts else ''}")
    if w.expert_values and p.experts_kept:
        fmt = p.checkpoint_experts.upper()
        assumed = (" (config.json names no expert format: the released checkpoint's)"
                   if p.format_assumed else "")
        lines.append(f"    routed experts per rank: {_gib(w.experts * share)} as {fmt} with "
                     f"scales, kept in the checkpoint's format{assumed} "
                     f"({_gib(p.dense_experts * share)} if dequantised to {dtype})")
    elif w.expert_values:
        fmts = [p.checkpoint_experts] if p.checkpoint_experts in CHECKPOINT_EXPERT_BYTES \
            else list(CHECKPOINT_EXPERT_BYTES)
        named = "" if p.checkpoint_experts else " (config.json names no expert format)"
        kept = ", ".join(f"{_gib(w.experts_as(f) * share)} as {f.upper()} with scales"
                         for f in fmts)
        lines.append(f"    routed experts per rank: {_gib(w.experts * share)} as loaded today "
                     f"({dtype}, dequantised at load) vs {kept}{named}")
    return lines


def _packed_capacity_lines(w: WeightBytes, per_rank: float, kv_per_token: float,
                           kv_bounded: float, per_request: float, p: PlanInputs) -> list[str]:
    """The same rank if the routed experts were in checkpoint format (config.json names none,
    or the loader does not keep this layout packed), so the guide shows what that buys."""
    fmt = p.checkpoint_experts if p.checkpoint_experts in CHECKPOINT_EXPERT_BYTES else "fp4"
    ratio = w.experts_as(fmt) / w.experts
    experts = w.per_rank(p.ranks, p.expert_parallel, p.num_redundant_experts) - w.rest
    packed = w.rest + experts * ratio
    cap = _capacity_lines(packed, kv_per_token, kv_bounded, per_request, p)
    return [f"  if the experts were held as {fmt.upper()} with scales (the loader does not keep "
            f"this model's experts packed): weights {_gib(packed)} instead of {_gib(per_rank)}",
            *("  " + line for line in cap[1:])]


def _capacity_lines(per_rank: float, kv_per_token: float, kv_bounded: int,
                    per_request: float, p: PlanInputs) -> list[str]:
    usable = p.memory_per_rank * p.utilization
    left = usable - per_rank - p.reserve - kv_bounded * p.max_num_seqs
    reserve = f" - activations {_gib(p.reserve)}" if p.reserve else ""
    head = (f"  with {_gib(p.memory_per_rank)} per rank x {p.utilization:g}: "
            f"{_gib(usable)} - weights {_gib(per_rank)}{reserve} - windows of "
            f"{p.max_num_seqs} requests {_gib(kv_bounded * p.max_num_seqs)} = "
            f"{_gib(max(left, 0))} for KV")
    if left <= 0:
        return [head, "  DOES NOT FIT: add ranks (--data-parallel-size with "
                      "--enable-expert-parallel) or memory"]
    tokens = int(left // kv_per_token) if kv_per_token else 0
    full = int(left // per_request) if per_request else 0
    fits = "" if full >= 1 else " (NOT ONE full-context request: lower --max-model-len)"
    lines = [head,
             f"  KV capacity:        {tokens:,} tokens of context per rank, shared by its "
             f"running requests = {full:,} requests at {p.max_model_len:,} tokens{fits}"]
    if full < p.max_num_seqs and per_request:
        at = int((left / p.max_num_seqs - kv_bounded) // kv_per_token) if kv_per_token else 0
        lines.append(f"  {p.max_num_seqs} requests per rank fit at {max(at, 0):,} tokens each "
                     f"(not at {p.max_model_len:,})")
    return lines


def _min_ranks_line(w: WeightBytes, p: PlanInputs) -> str:
    usable = p.memory_per_rank * p.utilization
    if usable <= w.rest:
        return (f"  the non-expert weights alone ({_gib(w.rest)}) exceed "
                f"{_gib(usable)}: no DEP size fits")
    n = max(1, math.ceil(w.experts / (usable - w.rest)))
    return (f"  fewest DEP ranks for the weights alone: {n} (then little room for KV; "
            f"the KV capacity above is for {p.ranks})")
