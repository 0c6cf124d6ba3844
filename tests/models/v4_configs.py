"""Tiny DeepSeek-V4 configs (kwargs valid for both transformers' DeepseekV4Config and
wideserve's DeepseekV4Config.from_dict). A, B, C are docs/deepseek_v4.md's "Test configurations"; D and E are
ours (legacy keys, sigmoid scoring, shared-expert bias, hash after moe, ratio 1/2 compressors,
dense CSA). The real V4-Flash config is FLASH (meta-device use only)."""
from __future__ import annotations

COMMON = dict(vocab_size=256, rms_norm_eps=1e-6, scoring_func="sqrtsoftplus",
              routed_scaling_factor=1.5, swiglu_limit=10.0, n_shared_experts=1,
              num_key_value_heads=1, rope_theta=1e4, compress_rope_theta=1.6e5,
              max_position_embeddings=4096, tie_word_embeddings=False,
              num_nextn_predict_layers=0, initializer_range=0.1)

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

A = dict(COMMON, num_hidden_layers=4, layer_types=[SWA, CSA, HCA, CSA],
         mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hidden_size=64,
         num_attention_heads=4, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32,
         o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2,
         moe_intermediate_size=32, compress_rates={CSA: 4, HCA: 8}, sliding_window=8,
         index_n_heads=2, index_head_dim=16, index_topk=3, hc_mult=2, hc_sinkhorn_iters=3,
         rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                       "beta_fast": 32, "beta_slow": 1})

B = dict(COMMON, num_hidden_layers=6, compress_ratios=[0, 0, 4, 128, 4, 128, 0],
         num_hash_layers=3, hidden_size=128, num_attention_heads=8, head_dim=64,
         qk_rope_head_dim=8, q_lora_rank=64, o_groups=4, o_lora_rank=32, n_routed_experts=16,
         num_experts_per_tok=4, moe_intermediate_size=64, sliding_window=128,
         index_n_heads=4, index_head_dim=32, index_topk=16, hc_mult=4, hc_sinkhorn_iters=20,
         initializer_range=0.05,
         rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 512,
                       "beta_fast": 32, "beta_slow": 1})

C = dict(COMMON, num_hidden_layers=3, layer_types=[HCA, CSA, CSA],
         mlp_layer_types=["hash_moe", "moe", "moe"], hidden_size=32, num_attention_heads=2,
         head_dim=16, partial_rotary_factor=0.5, q_lora_rank=16, o_groups=1, o_lora_rank=16,
         n_routed_experts=4, num_experts_per_tok=1, moe_intermediate_size=16,
         compress_rates={CSA: 2, HCA: 3}, sliding_window=2, index_n_heads=1, index_head_dim=8,
         index_topk=1, hc_mult=1, hc_sinkhorn_iters=1)

# Legacy scalar rates, sigmoid router, shared-expert bias, a hash layer after a top-k one,
# hc_mult 3, o_groups 3, rope dims 4.
D = dict(COMMON, num_hidden_layers=3, layer_types=[CSA, SWA, HCA], compress_rate_csa=3,
         compress_rate_hca=5, mlp_layer_types=["moe", "hash_moe", "moe"], hidden_size=48,
         num_attention_heads=3, head_dim=16, qk_rope_head_dim=4, q_lora_rank=24, o_groups=3,
         o_lora_rank=8, n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
         scoring_func="sigmoid", mlp_bias=True, sliding_window=5, index_n_heads=3,
         index_head_dim=8, index_topk=2, hc_mult=3, hc_sinkhorn_iters=5)

# Ratio-1 HCA (every position is an entry, visible to itself), ratio-2 CSA with index_topk
# above the entry count (dense CSA path), window 3.
E = dict(COMMON, num_hidden_layers=2, layer_types=[HCA, CSA], mlp_layer_types=["moe", "moe"],
         compress_rates={CSA: 2, HCA: 1}, hidden_size=32, num_attention_heads=2, head_dim=16,
         partial_rotary_factor=0.5, q_lora_rank=16, o_groups=2, o_lora_rank=8,
         n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, sliding_window=3,
         index_n_heads=2, index_head_dim=8, index_topk=64, hc_mult=2, hc_sinkhorn_iters=4)

# DeepSeek-V4-Flash (docs/deepseek_v4.md, "Configuration"), official-style keys.
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "q_lora_rank": 1024, "qk_rope_head_dim": 64, "num_experts_per_tok": 6,
    "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "topk_method": "noaux_tc",
    "max_position_embeddings": 1048576, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_hash_layers": 3,
    "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}
