"""Small simulator inputs built directly (no engine, no meta model): fast and exact."""
from __future__ import annotations

import dataclasses

from wideserve.sim.hardware import Hardware, Profile, load_hardware
from wideserve.sim.model import ModelShape, shape_from_config

V41_LIKE = {
    "model_type": "deepseek_v41", "hidden_size": 512, "num_hidden_layers": 8,
    "num_attention_heads": 8, "head_dim": 64, "n_routed_experts": 32, "num_experts_per_tok": 4,
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 64, "sliding_window": 16,
    "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1], "kv_source_layer_ids": [1, 4],
    "index_source_layer_ids": [1, 4, 6], "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 8, "candidate_block_size": 4, "num_nextn_predict_layers": 1,
    "dspark_n_routed_experts": 16, "dspark_num_experts_per_tok": 2,
}


def tiny_model() -> ModelShape:
    split = {"dense": 40_000_000, "experts": 8 * 32 * 3 * 512 * 256, "draft_dense": 4_000_000,
             "draft_experts": 16 * 3 * 512 * 256}
    return shape_from_config(V41_LIKE, split, 300.0, 100_000,
                             {"window": 528, "compressed": 288, "indexer": 68}, "tiny", "bf16")


def profile(jitter: list[float] | None = None) -> Profile:
    return Profile("test", {"base_s": 1e-3, "per_request_s": 1e-5, "per_token_s": 1e-6,
                            "jitter_s": jitter or [0.0]},
                   {"allreduce_alpha_s": 2e-5, "alltoall": {"alpha_s": 1e-5,
                                                            "bytes_per_s": 1e10}},
                   {}, 1e10, 1e11)


def gpu(**scale: float) -> Hardware:
    """GB200 with some fields multiplied (e.g. mem_bytes_per_s=2)."""
    hw = load_hardware("gb200")
    return dataclasses.replace(hw, **{k: getattr(hw, k) * v for k, v in scale.items()})
