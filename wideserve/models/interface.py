"""What the engine needs from a model."""
from __future__ import annotations

from typing import Iterable, Protocol

import torch

from wideserve.core.kv_cache.spec import KVCacheSpec
from wideserve.executor.forward_batch import ForwardBatch


class CausalLM(Protocol):
    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> dict[str, KVCacheSpec]:
        """Cache name (e.g. "model.layers.3.self_attn.window") -> spec; the names key
        ForwardBatch.kv_caches. kv_cache_dtype: "auto" (model dtype), "bf16", or "fp8"
        (quantised records: FP8 window/compressed latents, MXFP4 indexer keys)."""

    def param_counts(self) -> tuple[int, int]:
        """(total parameters, parameters active per token)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, one row per new token."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume (HF-style name, tensor) pairs; return the names of parameters filled."""
