"""Qwen3-MoE."""
