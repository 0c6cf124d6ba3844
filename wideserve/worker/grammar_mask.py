"""JSON Schema checks and the token-mask helpers the sampler uses."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class GrammarMask:
    """Rows of a step's logits that a grammar constrains, and their allowed tokens."""
    rows: torch.Tensor          # [G] int64
    bitmask: torch.Tensor       # [G, ceil(V / 32)] int32, bit set = token allowed

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Out of place: disallowed tokens of the constrained rows to -inf, in one pass."""
        allowed = unpack_bitmask(self.bitmask, logits.size(1))
        sub = logits.index_select(0, self.rows).masked_fill(~allowed, float("-inf"))
        return logits.index_copy(0, self.rows, sub)


def schema_error(schema: dict[str, Any]) -> str:
    """'' when llguidance can build a grammar from the JSON Schema, else its message."""
    import llguidance
    try:
        return llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    except (ValueError, TypeError, RuntimeError) as e:
        return str(e)


def fill_bitmask_row(matcher: Any, bitmask: torch.Tensor, row: int) -> None:
    """The matcher's next-token mask into row `row` of a host int32 bitmask, in place.
    What `llguidance.torch.fill_next_token_bitmask` does, without importing that module: it
    decorates a function with torch.compile at import, which loads torch's compiler stack
    (0.9-1.6 s on the engine thread at the first constrained step, stalling every stream)."""
    assert bitmask.dtype == torch.int32 and not bitmask.is_cuda and bitmask.dim() == 2
    v = bitmask[row]
    assert v.is_contiguous()
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 (bit t % 32 of word t // 32 = token t allowed) -> [G, V] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.size(0), -1)[:, :vocab_size].bool()
