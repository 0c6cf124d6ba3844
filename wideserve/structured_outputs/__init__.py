"""Structured outputs: constrained decoding with llguidance (see docs/structured_outputs.md)."""
