"""Llama / Qwen2 / Qwen3 (dense, GQA)."""
