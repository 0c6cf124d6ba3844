"""Attention: every attention kind's layer, backends and per-step layouts (registry.py).

DeepSeek-V4 (CSA / HCA / sliding window):
  v4_attention.py    the layer; v4_step.py builds the per-step layouts once per forward
  v4_reference.py    per-request reference ops (the oracle)
  v4_batched.py, v4_blocks.py   batched ops across requests (the default)
DeepSeek-V4.1 (CSA2 with cross-layer KV sharing, two-level indexer):
  v41_attention.py   the layer, its compressor and indexer; attention is v4_batched.attend
Standard grouped-query paged attention (Llama / Qwen2 / Qwen3 / Qwen3-MoE):
  paged_attention.py (reference), paged_attention_batched.py (the default),
  paged_decode_static.py (decode in static shapes over device metadata: CUDA graphs)
registry.py: the backend tables of both kinds and how a name is chosen.
"""
