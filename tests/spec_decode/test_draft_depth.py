"""Speculation depth per batch size: requests x (k + 1) verified tokens within the budget."""
from __future__ import annotations

import pytest

from wideserve.spec_decode.config import SpeculativeConfig
from wideserve.spec_decode.decoder import draft_depth


def test_depth_shrinks_with_the_batch() -> None:
    assert [draft_depth(3, b, 32) for b in (1, 4, 8, 9, 16, 17, 32, 64)] == \
        [3, 3, 3, 2, 1, 0, 0, 0]
    assert draft_depth(3, 64, 0) == 3                  # budget 0: always k
    assert draft_depth(2, 0, 32) == 2


def test_budget_is_validated() -> None:
    with pytest.raises(ValueError, match="batch_token_budget"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, batch_token_budget=-1)
