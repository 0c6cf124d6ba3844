"""DeepSeek-V4.1 configuration (docs/deepseek_v41.md).

config.json is either the nested layout of the reference (`model_type` "deepseek_v41", the
text model under `text_config`, a vision tower under `vision_config`) or the same keys flat.
Defaults are DeepSeek-V4.1-Flash. A `vision_config` with layers (the released checkpoint's
32-layer ViT) builds the vision tower (models/deepseek_v41/vision.py); an absent one, or
`num_hidden_layers` 0, or `--limit-mm-per-prompt image=0` (`without_vision`), builds the text
model alone.

Layer modes (per layer i < num_hidden_layers, from compress_ratios / kv_source_layer_ids /
index_source_layer_ids):
- "swa": ratio 0, sliding window only;
- "full": a KV source: owns a CSA2 compressor (compressed entries) and the indexer keys;
- "reindex": scores the latest source's keys with its own indexer queries (new top-k);
- "reuse": reads the latest source's entries with the latest index source's top-k.
The candidate source (a full layer) also picks candidate blocks that later index sources
restrict their top-k to (the two-level indexer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

SWA, FULL, REINDEX, REUSE = "swa", "full", "reindex", "reuse"


def _flash_ratios() -> list[int]:
    return [0, 0] + [2] * 18 + [1] * 20 + [0] * 3


@dataclass(slots=True)
class DeepseekV41VisionConfig:
    """The reference's DeepseekV41VisionConfig (its defaults are the released ViT's)."""
    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None

    @classmethod
    def from_dict(cls, src: dict[str, Any]) -> DeepseekV41VisionConfig:
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in src.items() if k in names})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        where = "DeepSeek-V4.1 config: vision_config"
        for name in ("hidden_size", "num_attention_heads", "intermediate_size", "patch_size",
                     "downsample_ratio", "max_image_tokens", "min_pixels"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{where}.{name} must be a positive integer, got {value!r}")
        if type(self.num_hidden_layers) is not int or self.num_hidden_layers < 0:
            raise ValueError(f"{where}.num_hidden_layers must be a non-negative integer")
        if self.hidden_size % self.num_attention_heads or \
                self.hidden_size // self.num_attention_heads % 4:
            raise ValueError(f"{where}: hidden_size / num_attention_heads must be an integer "
                             f"divisible by 4 (2D RoPE)")
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 0:
            raise ValueError(f"{where}.rope_theta must be finite and positive")
        if self.max_image_tokens < 4:
            raise ValueError(f"{where}.max_image_tokens must be at least 4")
        if self.max_wh_ratio is not None and (not math.isfinite(self.max_wh_ratio)
                                              or self.max_wh_ratio < 1):
            raise ValueError(f"{where}.max_wh_ratio must be null or at least 1")


@dataclass(slots=True)
class DeepseekV41Config:
    vocab_size: int = 129280
    hidden_size: int = 5120
    moe_intermediate_size: int = 2304
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=lambda: {
        "rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 65536})
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    sliding_window: int = 128
    compress_ratios: list[int] = field(default_factory=_flash_ratios)
    compress_rope_theta: float = 160000.0
    kv_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list[int] = field(
        default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: list[int] = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list[int] = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = 2
    quantization_config: dict[str, Any] | None = None
    # The vision tower (None: text model alone) and the placeholder id of image positions.
    vision: DeepseekV41VisionConfig | None = None
    image_token_id: int = 129264
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ derived
    def compress_ratio(self, layer: int) -> int:
        return int(self.compress_ratios[layer])

    def layer_mode(self, layer: int) -> str:
        if self.compress_ratio(layer) == 0:
            return SWA
        if layer in self.kv_source_layer_ids:
            return FULL
        return REINDEX if layer in self.index_source_layer_ids else REUSE

    def kv_source_of(self, layer: int) -> int:
        """The latest KV source at or below a compressed layer."""
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        return 0 <= self.candidate_source_layer_id < layer

    @property
    def engram_layers(self) -> list[int]:
        return [i for i in self.engram_layer_ids if i < self.num_hidden_layers]

    @property
    def has_vision(self) -> bool:
        return self.vision is not None and self.vision.num_hidden_layers > 0

    def without_vision(self) -> DeepseekV41Config:
        """The text model alone (--limit-mm-per-prompt image=0): no vision tower is built and
        the checkpoint's vision tensors are skipped."""
        return replace(self, vision=None)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, config_json: dict[str, Any]) -> DeepseekV41Config:
        src = dict(config_json)
        text = src.pop("text_config", None)
        vision = src.pop("vision_config", None)
        if vision is not None and not isinstance(vision, dict):
            raise ValueError(f"DeepSeek-V4.1 config: vision_config must be an object, got "
                             f"{type(vision).__name__}")
        if isinstance(text, dict):
            src = {**src, **text}
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in src.items() if k in names and k not in ("extra", "vision")}
        cfg = cls(**known)
        if vision:
            cfg.vision = DeepseekV41VisionConfig.from_dict(vision)
        cfg.torch_dtype = config_json.get("torch_dtype") or config_json.get("dtype") \
            or (text or {}).get("dtype")
        cfg.extra = {k: v for k, v in src.items() if k not in names}
        cfg.validate()
        return cfg

    def validate(self) -> None:
        where = "DeepSeek-V4.1 config"
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window",
                     "index_n_heads", "index_head_dim", "index_topk", "hc_mult"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"{where}: num_attention_heads must be divisible by o_groups")
        if self.n_shared_experts != 1:
            raise ValueError(f"{where}: n_shared_experts must be 1")
        self._validate_layout()
        if self.engram_layers and self.engram_max_ngram_size < 2:
            raise ValueError(f"{where}: engram_max_ngram_size must be >= 2")
        if not math.isfinite(self.rms_norm_eps) or self.rms_norm_eps <= 0:
            raise ValueError(f"{where}: rms_norm_eps must be positive")

    def _validate_layout(self) -> None:
        """The reference's layer-layout rules (docs/deepseek_v41.md, "Layer layout": its
        config's schedule check, and the rule its forward enforces: a KV source after the
        candidate source has no candidates to restrict to), each refused naming the layer."""
        n, ratios = self.num_hidden_layers, self.compress_ratios
        where = "DeepSeek-V4.1 config"
        if len(ratios) < n:
            raise ValueError(f"{where}: compress_ratios has {len(ratios)} entries for {n} "
                             f"layers (one per layer is required)")
        bad = [i for i, r in enumerate(ratios) if type(r) is not int or r < 0]
        if bad:
            raise ValueError(f"{where}: compress_ratios[{bad[0]}] = {ratios[bad[0]]!r}; "
                             f"ratios must be non-negative integers")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, name)
            bad = [i for i in ids if type(i) is not int or not 0 <= i < len(ratios)]
            if bad:
                raise ValueError(f"{where}: {name} has layer {bad[0]!r}; layer ids must be "
                                 f"integers in 0..{len(ratios) - 1} (covered by compress_ratios)")
            if list(ids) != sorted(set(ids)):
                raise ValueError(f"{where}: {name} {list(ids)} must be strictly increasing")
        missing = sorted(set(self.kv_source_layer_ids) - set(self.index_source_layer_ids))
        if missing:
            raise ValueError(f"{where}: KV source layer {missing[0]} is not in "
                             f"index_source_layer_ids; every KV source is also an index source")
        owner = None
        for i in range(n):
            ratio = ratios[i]
            if ratio == 0:
                if i in self.kv_source_layer_ids or i in self.index_source_layer_ids:
                    raise ValueError(f"{where}: SWA layer {i} cannot be a KV or index source")
                continue
            if i in self.kv_source_layer_ids:
                owner = ratio
            if owner != ratio:
                raise ValueError(f"{where}: compressed layer {i} (ratio {ratio}) needs an "
                                 f"earlier KV source with the same compress ratio")
        c = self.candidate_source_layer_id
        if type(c) is not int or c < -1:
            raise ValueError(f"{where}: candidate_source_layer_id must be -1 (off) or a layer "
                             f"id, got {c!r}")
        if c >= 0 and c not in self.kv_source_layer_ids:
            raise ValueError(f"{where}: candidate_source_layer_id {c} must be a KV source")
        if c >= 0 and (self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0):
            raise ValueError(f"{where}: candidate_block_size and candidate_topk_blocks must "
                             f"be positive")
        later = [i for i in self.index_source_layer_ids
                 if 0 <= c < i < n and ratios[i] != ratios[c]]
        if later:
            raise ValueError(f"{where}: index source {later[0]} comes after the candidate "
                             f"source {c} but has another compress ratio; its top-k chooses "
                             f"among the candidate blocks' entries, so the ratios must match")
        after = [i for i in self.kv_source_layer_ids if 0 <= c < i < n]
        if after:
            raise ValueError(f"{where}: KV source layer {after[0]} comes after the candidate "
                             f"source {c}; layers after the candidate source restrict their "
                             f"top-k to its candidate blocks, so no new KV source may follow it")
        if len(self.engram_layer_ids) != len(self.engram_num_embeddings):
            raise ValueError(f"{where}: engram_num_embeddings needs one row count per "
                             f"engram_layer_ids entry")
        bad = [r for r in self.engram_num_embeddings if type(r) is not int or r <= 0]
        if bad:
            raise ValueError(f"{where}: engram_num_embeddings has {bad[0]!r}; row counts must "
                             f"be positive integers")
