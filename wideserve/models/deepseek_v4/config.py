"""DeepSeek-V4 configuration, parsed from a config.json dict (docs/deepseek_v4.md, "Configuration").

Accepts both the Hugging Face (transformers 5.23) key set and the legacy keys that official
checkpoints ship: `compress_ratios` (one int per layer, 0 / CSA ratio / HCA ratio, with an extra
trailing MTP slot that is dropped), `compress_rate_csa` / `compress_rate_hca`, `num_hash_layers`,
`qk_rope_head_dim`, `rope_scaling` (becomes the "compress" rope; YaRN there never scales cos/sin,
i.e. attention_factor 1) and a top-level `expert_dtype` (folded into `quantization_config`).
Keys we do not use are kept in `extra`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn")

# Scalar keys copied as-is: name -> (type, default). Defaults are V4-Flash(-Base) (HF defaults).
_SCALARS: dict[str, tuple[type, Any]] = {
    "vocab_size": (int, 129280),
    "hidden_size": (int, 4096),
    "moe_intermediate_size": (int, 2048),
    "num_hidden_layers": (int, 43),
    "num_attention_heads": (int, 64),
    "num_key_value_heads": (int, 1),
    "head_dim": (int, 512),
    "q_lora_rank": (int, 1024),
    "num_experts_per_tok": (int, 6),
    "n_routed_experts": (int, 256),
    "n_shared_experts": (int, 1),
    "scoring_func": (str, "sqrtsoftplus"),
    "norm_topk_prob": (bool, True),
    "routed_scaling_factor": (float, 1.5),
    "max_position_embeddings": (int, 1048576),
    "rope_theta": (float, 10000.0),
    "compress_rope_theta": (float, 160000.0),
    "hc_mult": (int, 4),
    "hc_sinkhorn_iters": (int, 20),
    "hc_eps": (float, 1e-6),
    "swiglu_limit": (float, 10.0),
    "sliding_window": (int, 128),
    "o_groups": (int, 8),
    "o_lora_rank": (int, 1024),
    "index_n_heads": (int, 64),
    "index_head_dim": (int, 128),
    "index_topk": (int, 512),
    "num_nextn_predict_layers": (int, 1),
    "hidden_act": (str, "silu"),
    "initializer_range": (float, 0.02),
    "rms_norm_eps": (float, 1e-6),
    "tie_word_embeddings": (bool, False),
    "attention_bias": (bool, False),
    "mlp_bias": (bool, False),
}
_ALIASES = {"num_local_experts": "n_routed_experts", "intermediate_size": "moe_intermediate_size"}
_FIXED_RATIO_TYPES = {4: CSA, 128: HCA}   # how HF reads legacy compress_ratios


@dataclass(slots=True)
class DeepseekV4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True            # HF ignores it; see layers/moe.py for the rule used
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    compress_rates: dict[str, int] = field(default_factory=dict)
    partial_rotary_factor: float = 64 / 512
    # {"main": {...}, "compress": {...}}, each with rope_type, rope_theta (+ YaRN keys).
    rope_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    quantization_config: dict[str, Any] | None = None
    expert_dtype: str | None = None
    torch_dtype: str | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ derived
    @property
    def qk_rope_head_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def csa_ratio(self) -> int:
        return self.compress_rates[CSA]

    @property
    def hca_ratio(self) -> int:
        return self.compress_rates[HCA]

    def compress_ratio(self, layer: int) -> int:
        """0 for a pure sliding-window layer, else the layer's compression ratio."""
        t = self.layer_types[layer]
        return 0 if t == SLIDING else self.compress_rates[t]

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, config_json: dict[str, Any]) -> DeepseekV4Config:
        src = dict(config_json)
        for alias, name in _ALIASES.items():
            if alias in src:
                src.setdefault(name, src.pop(alias))
        kw: dict[str, Any] = {}
        for name, (typ, default) in _SCALARS.items():
            value = src.pop(name, default)
            kw[name] = default if value is None else _coerce(name, value, typ)
        cfg = cls(**kw)
        n = cfg.num_hidden_layers
        if n < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {n}")

        cfg.compress_rates = _compress_rates(src)
        cfg.layer_types = _layer_types(src, n, cfg.compress_rates)
        cfg.mlp_layer_types = _mlp_layer_types(src, n)
        cfg.partial_rotary_factor = _rotary_factor(src, cfg.head_dim)
        cfg.rope_parameters = _rope_parameters(src, cfg)
        cfg.expert_dtype = src.pop("expert_dtype", None)
        qc = src.pop("quantization_config", None)
        if isinstance(qc, dict) and cfg.expert_dtype is not None and "expert_dtype" not in qc:
            qc = {**qc, "expert_dtype": cfg.expert_dtype}
        cfg.quantization_config = qc
        cfg.torch_dtype = src.pop("torch_dtype", None) or src.pop("dtype", None)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in src:
                setattr(cfg, key, src.pop(key))
        cfg.extra = src
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"DeepSeek-V4 config: {key} {why}")

        if self.num_key_value_heads != 1:
            raise bad("num_key_value_heads", f"must be 1 (shared K=V latent), got "
                      f"{self.num_key_value_heads}")
        if self.n_shared_experts != 1:
            raise bad("n_shared_experts", f"must be 1, got {self.n_shared_experts}")
        if self.hidden_act != "silu":
            raise bad("hidden_act", f"must be 'silu', got {self.hidden_act!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise bad("scoring_func", f"must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise bad("num_experts_per_tok", f"must be in [1, n_routed_experts="
                      f"{self.n_routed_experts}], got {self.num_experts_per_tok}")
        if self.num_attention_heads % self.o_groups:
            raise bad("o_groups", f"({self.o_groups}) must divide num_attention_heads "
                      f"({self.num_attention_heads})")
        r = self.head_dim * self.partial_rotary_factor
        if r != int(r) or int(r) % 2 or not 0 < r <= min(self.head_dim, self.index_head_dim):
            raise bad("partial_rotary_factor", f"gives {r} rotary dims; need an even integer "
                      f"<= head_dim and index_head_dim")
        for key in ("sliding_window", "hc_mult", "hc_sinkhorn_iters", "index_topk",
                    "index_n_heads"):
            if getattr(self, key) < 1:
                raise bad(key, f"must be >= 1, got {getattr(self, key)}")
        if self.num_nextn_predict_layers < 0:
            raise bad("num_nextn_predict_layers", "must be >= 0")


def _coerce(name: str, value: Any, typ: type) -> Any:
    if typ is bool:
        if not isinstance(value, bool):
            raise ValueError(f"DeepSeek-V4 config: {name} must be a bool, got {value!r}")
        return value
    if typ is str:
        if not isinstance(value, str):
            raise ValueError(f"DeepSeek-V4 config: {name} must be a string, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"DeepSeek-V4 config: {name} must be a number, got {value!r}")
    if typ is int and value != int(value):
        raise ValueError(f"DeepSeek-V4 config: {name} must be an integer, got {value!r}")
    return typ(value)


def _compress_rates(src: dict[str, Any]) -> dict[str, int]:
    rates = {CSA: 4, HCA: 128}
    given = src.pop("compress_rates", None)
    if given is not None:
        if not isinstance(given, dict) or set(given) - {CSA, HCA}:
            raise ValueError(f"DeepSeek-V4 config: compress_rates must map {CSA!r} / {HCA!r} "
                             f"to ints, got {given!r}")
        rates.update(given)
    for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        value = src.pop(key, None)
        if value is not None:
            rates[layer_type] = value
    for layer_type, value in rates.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"DeepSeek-V4 config: compress rate for {layer_type} must be a "
                             f"positive int, got {value!r}")
    return rates


def _layer_types(src: dict[str, Any], n: int, rates: dict[str, int]) -> list[str]:
    types = src.pop("layer_types", None)
    ratios = src.pop("compress_ratios", None)
    if types is None and ratios is not None:
        types = []
        for i, ratio in enumerate(ratios[:n]):
            if ratio == 0:
                types.append(SLIDING)
            elif ratio == rates[CSA]:
                types.append(CSA)
            elif ratio == rates[HCA]:
                types.append(HCA)
            elif ratio in _FIXED_RATIO_TYPES:
                types.append(_FIXED_RATIO_TYPES[ratio])
            else:
                raise ValueError(f"DeepSeek-V4 config: compress_ratios[{i}] = {ratio!r} is not "
                                 f"0, the CSA rate {rates[CSA]} or the HCA rate {rates[HCA]}")
    if types is None:
        # HF's default (2x HCA, then HCA/CSA alternating); matches no released checkpoint.
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return _per_layer("layer_types", list(types), n, LAYER_TYPES)


def _mlp_layer_types(src: dict[str, Any], n: int) -> list[str]:
    types = src.pop("mlp_layer_types", None)
    n_hash = src.pop("num_hash_layers", None)
    if types is None:
        n_hash = 3 if n_hash is None else n_hash
        types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    return _per_layer("mlp_layer_types", list(types), n, MLP_TYPES)


def _per_layer(key: str, types: list[str], n: int, allowed: tuple[str, ...]) -> list[str]:
    if len(types) < n:
        raise ValueError(f"DeepSeek-V4 config: {key} has {len(types)} entries but "
                         f"num_hidden_layers is {n}")
    types = types[:n]   # longer lists (e.g. with an MTP slot) are truncated, as in HF
    wrong = [t for t in types if t not in allowed]
    if wrong:
        raise ValueError(f"DeepSeek-V4 config: {key} entries must be one of {allowed}, got {wrong}")
    return types


def _rotary_factor(src: dict[str, Any], head_dim: int) -> float:
    factor = src.pop("partial_rotary_factor", None)
    legacy = src.pop("qk_rope_head_dim", None)
    if factor is None:
        factor = legacy / head_dim if legacy is not None else 64 / 512
    return float(factor)


def _rope_parameters(src: dict[str, Any], cfg: DeepseekV4Config) -> dict[str, dict[str, Any]]:
    rp = src.pop("rope_parameters", None)
    scaling = src.pop("rope_scaling", None)
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(
            rp.get("compress"), dict):
        # Already nested (an HF-saved config): use as given.
        params = {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
        params["main"].setdefault("rope_theta", cfg.rope_theta)
        params["compress"].setdefault("rope_theta", cfg.compress_rope_theta)
    else:
        flat = {k: v for k, v in (scaling or rp or {}).items() if k not in ("main", "compress")}
        compress = {**flat, "rope_theta": cfg.compress_rope_theta}
        compress["rope_type"] = compress.get("rope_type", compress.pop("type", "default"))
        compress.pop("type", None)
        if compress["rope_type"] == "yarn":
            # The V4 reference never multiplies cos/sin by YaRN's mscale.
            compress.setdefault("attention_factor", 1.0)
        params = {"main": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                  "compress": compress}
    for label, p in params.items():
        p["rope_type"] = p.get("rope_type", p.pop("type", "default"))
        p.pop("type", None)
        p["partial_rotary_factor"] = cfg.partial_rotary_factor
        if p["rope_type"] not in ROPE_TYPES:
            raise ValueError(f"DeepSeek-V4 config: rope_parameters[{label!r}].rope_type "
                             f"{p['rope_type']!r} is not supported (use one of {ROPE_TYPES})")
        if p["rope_type"] == "yarn":
            if "original_max_position_embeddings" not in p:
                raise ValueError(f"DeepSeek-V4 config: YaRN rope ({label}) needs "
                                 f"original_max_position_embeddings")
            if p.get("factor") is None:
                p["factor"] = cfg.max_position_embeddings / p["original_max_position_embeddings"]
            if not math.isfinite(p["factor"]) or p["factor"] <= 0:
                raise ValueError(f"DeepSeek-V4 config: YaRN factor ({label}) must be > 0")
    return params
