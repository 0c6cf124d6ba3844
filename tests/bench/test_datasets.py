"""Benchmark prompts: lengths, exact token counts of text prompts, shared prefixes."""
from __future__ import annotations

import numpy as np
import pytest

from wideserve.bench.datasets import (WordVocab, random_requests, sample_lengths,
                                      shared_prefix_requests, token_pool)
from wideserve.worker.model_loader import BUNDLED_MODEL
from wideserve.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(BUNDLED_MODEL)


def test_sample_lengths_range():
    v = sample_lengths(np.random.default_rng(0), 2000, 100, 0.2)
    assert v.min() >= 80 and v.max() <= 120 and 95 <= v.mean() <= 105
    assert set(sample_lengths(np.random.default_rng(0), 10, 7, 0.0).tolist()) == {7}
    with pytest.raises(ValueError, match="range_ratio"):
        sample_lengths(np.random.default_rng(0), 1, 10, 1.5)


def test_token_prompts_avoid_special_ids():
    pool = token_pool(64, [0, 1, 2])
    reqs = random_requests(20, 30, 5, 0.5, seed=3, pool=pool)
    ids = {t for r in reqs for t in r.prompt_token_ids}
    assert not ids & {0, 1, 2} and ids <= set(range(64))
    assert all(15 <= r.prompt_len <= 45 and r.prompt is None for r in reqs)
    again = random_requests(20, 30, 5, 0.5, seed=3, pool=pool)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]


def test_text_prompts_encode_to_exact_lengths(tok):
    words = WordVocab(tok)
    for r in random_requests(10, 200, 8, 0.3, seed=1, words=words):
        assert tok.encode(r.prompt, add_special_tokens=False) == r.prompt_token_ids


def test_shared_prefix_blocks_are_identical(tok):
    words = WordVocab(tok)
    reqs = shared_prefix_requests(8, 2, prefix_len=100, suffix_len=20, output_len=4, seed=0,
                                  words=words)
    assert [r.group for r in reqs] == [0, 1] * 4
    for r in reqs:
        assert r.prompt_len == 120
        assert tok.encode(r.prompt, add_special_tokens=False) == r.prompt_token_ids
        assert r.prompt_token_ids[:100] == reqs[r.group].prompt_token_ids[:100]
    assert reqs[0].prompt_token_ids[:100] != reqs[1].prompt_token_ids[:100]
    assert reqs[0].prompt_token_ids[100:] != reqs[2].prompt_token_ids[100:]
