"""What the simulator needs to know about a model, read from its config.json and its real KV spec.

Parameter counts come from the model built on the meta device (no weights read, like
`wideserve info --plan`), split into routed experts and the rest, target and draft (the MTP /
DSpark blocks, `mtp.*`) separately; Engram tables stay in host memory and are not read per
step from device memory. KV bytes per token and per request come from the model's own
`kv_cache_specs` (the same numbers the engine sizes its pools with). The per-layer attention
layout (window, compression ratio, sparse top-k, how many indexer keys a query scores) comes
from the config keys the model classes read (docs/deepseek_v4.md, docs/deepseek_v41.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Bytes per parameter of a weight format as it sits in device memory (scales included):
# FP8 with one fp32 scale per 128x128 block; MXFP4 = e2m1 nibbles + one UE8M0 byte per 32.
FORMAT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4 / (128 * 128), "fp4": 0.5 + 1 / 32}
COMPUTE_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp8": "fp8", "fp4": "fp4"}


@dataclass(frozen=True, slots=True)
class AttnLayer:
    """One attention layer as a decode query sees it.

    window: raw window records read; ratio: positions per compressed entry (0: none);
    topk: compressed entries attended (None: all visible ones); scan: how many indexer keys
    a query scores ("all" visible entries, a fixed candidate count, or 0 = reuses indices)."""

    window: int
    ratio: int = 0
    topk: int | None = None
    scan: str | int = 0

    def entries(self, ctx: int) -> int:
        """Compressed entries read per query at context length ctx."""
        if not self.ratio:
            return 0
        visible = ctx // self.ratio
        return visible if self.topk is None else min(self.topk, visible)

    def scanned(self, ctx: int) -> int:
        if not self.ratio or self.scan == 0:
            return 0
        visible = ctx // self.ratio
        return visible if self.scan == "all" else min(int(self.scan), visible)


@dataclass(slots=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    moe_layers: int
    experts: int
    top_k: int
    heads: int
    head_dim: int
    index_heads: int
    index_dim: int
    attn: list[AttnLayer]
    dense_params: int            # target, non-expert, device-resident
    expert_params: int           # target routed experts, all layers
    draft_layers: int = 0
    draft_experts: int = 0
    draft_top_k: int = 0
    draft_dense_params: int = 0
    draft_expert_params: int = 0
    draft_parallel: bool = False  # DSpark drafts k tokens in one forward; MTP in k forwards
    kv_bytes_per_token: float = 0.0
    kv_bounded_bytes: int = 0
    record_bytes: dict[str, int] = field(default_factory=dict)
    weight_format: str = "bf16"
    expert_format: str = "bf16"

    @property
    def dense_bytes(self) -> float:
        return self.dense_params * FORMAT_BYTES[self.weight_format]

    def expert_params_each(self) -> float:
        return self.expert_params / max(1, self.moe_layers * self.experts)


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, **config.get("text_config", {})}


def attention_layout(config: dict[str, Any]) -> list[AttnLayer]:
    """Per-layer attention as the model classes build it."""
    c = _text(config)
    n, window = int(c["num_hidden_layers"]), int(c.get("sliding_window") or 0)
    mt = c.get("model_type", "")
    if mt == "deepseek_v41":
        ratios = c["compress_ratios"][:n]
        sources, index = set(c["kv_source_layer_ids"]), set(c["index_source_layer_ids"])
        cand = int(c["candidate_topk_blocks"]) * int(c["candidate_block_size"])
        cand_src = int(c["candidate_source_layer_id"])
        out = []
        for i, m in enumerate(ratios):
            scan: str | int = ("all" if i in sources else cand if i in index and i > cand_src
                               else 0) if m else 0
            out.append(AttnLayer(window, m, int(c["index_topk"]) if m else None, scan))
        return out
    if mt == "deepseek_v4":
        rates = c.get("compress_rates") or {}
        csa = int(rates.get("compressed_sparse_attention", 4))
        hca = int(rates.get("heavily_compressed_attention", 128))
        kinds = c.get("layer_types") or ["sliding_attention"] * n
        return [AttnLayer(window, csa, int(c["index_topk"]), "all")
                if k == "compressed_sparse_attention" else AttnLayer(window, hca)
                if k == "heavily_compressed_attention" else AttnLayer(window) for k in kinds[:n]]
    # Plain GQA/MHA (Llama, Qwen3-MoE): every layer reads its whole context (ratio 1, dense).
    return [AttnLayer(0, 1, None, 0) for _ in range(n)]


def _formats(config: dict[str, Any], dtype: str | None) -> tuple[str, str]:
    """(dense, expert) weight formats: as given, else the checkpoint's quantisation."""
    if dtype:
        return dtype, dtype
    qc = config.get("quantization_config") or {}
    dense = "fp8" if qc.get("quant_method") == "fp8" else \
        {"float32": "fp32"}.get(str(config.get("torch_dtype")), "bf16")
    experts = str(config.get("expert_dtype", qc.get("expert_dtype", dense)))
    return dense, experts if experts in FORMAT_BYTES else dense


def _param_split(model: Any) -> dict[str, int]:
    from wideserve.layers.engram import HostResident
    # Host-resident tables (V4.1's Engram) are not read as weights by a step.
    host = {name for name, m in model.named_modules() if isinstance(m, HostResident)}
    out = dict.fromkeys(("dense", "experts", "draft_dense", "draft_experts"), 0)
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[0] in host:
            continue
        key = ("draft_" if name.startswith("mtp.") else "") + (
            "experts" if ".experts." in name else "dense")
        out[key] += p.numel()
    return out


def _kv_bytes(model: Any) -> tuple[float, int, dict[str, int]]:
    from wideserve.kv_cache.spec import split_shared
    own, _ = split_shared(model.kv_cache_specs("auto"))
    records = {s.role: s.entry_bytes for s in own.values()}
    return (sum(s.bytes_per_token for s in own.values()),
            sum(s.bounded_bytes for s in own.values()), records)


def load_model(path: str | Path, dtype: str | None = None) -> ModelShape:
    """ModelShape of the model directory (config.json); built on the meta device."""
    import torch

    from wideserve.worker.model_loader import build_model, read_config, resolve_dtype
    from wideserve.models.registry import resolve_model_class

    config = read_config(Path(path))
    cls = resolve_model_class(config)
    model = build_model(cls, cls.config_class.from_dict(config),
                        resolve_dtype("auto", config), torch.device("meta"))
    split = _param_split(model)
    per_token, bounded, records = _kv_bytes(model)
    return shape_from_config(config, split, per_token, bounded, records, Path(path).name, dtype)


def shape_from_config(config: dict[str, Any], split: dict[str, int], kv_per_token: float,
                      kv_bounded: int, records: dict[str, int], name: str,
                      dtype: str | None = None) -> ModelShape:
    c = _text(config)
    n = int(c["num_hidden_layers"])
    experts = int(c.get("n_routed_experts") or c.get("num_experts") or 0)
    dense, expert_fmt = _formats(config, dtype)
    draft_layers = int(c.get("num_nextn_predict_layers") or 0)
    return ModelShape(
        name=name, hidden=int(c["hidden_size"]), layers=n,
        moe_layers=n if experts else 0, experts=experts,
        top_k=int(c.get("num_experts_per_tok") or 0),
        heads=int(c["num_attention_heads"]),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]),
        index_heads=int(c.get("index_n_heads") or 0), index_dim=int(c.get("index_head_dim") or 0),
        attn=attention_layout(config), dense_params=split["dense"],
        expert_params=split["experts"], draft_layers=draft_layers,
        draft_experts=int(c.get("dspark_n_routed_experts") or experts),
        draft_top_k=int(c.get("dspark_num_experts_per_tok") or c.get("num_experts_per_tok") or 0),
        draft_dense_params=split["draft_dense"], draft_expert_params=split["draft_experts"],
        draft_parallel=c.get("model_type") == "deepseek_v41",
        kv_bytes_per_token=kv_per_token, kv_bounded_bytes=kv_bounded, record_bytes=records,
        weight_format=dense, expert_format=expert_fmt)
