"""Benchmark prompts: `random` and `shared-prefix`, as token ids (offline) or text (HTTP).

Text prompts are built from a *word list*: vocabulary entries that decode to " word" and encode
back to exactly that one id. Under byte-level BPE (and SentencePiece-style "▁word" vocabularies)
a pre-tokeniser splits text before each such leading space, so a concatenation of k words is
exactly k tokens, and any block of words is byte-identical however it is combined. That is what
makes text prompts hit a length exactly and share prefix blocks exactly.

Lengths follow `vllm bench serve`'s upstream `--random-range-ratio` meaning: uniform integers in
[L(1 - r), L(1 + r)] (r = 0: fixed lengths).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from wideserve.text.tokenizer import Tokenizer

_WORD = re.compile(r"[ \u2581][A-Za-z]+")


@dataclass(slots=True)
class BenchRequest:
    """One request of a benchmark. `prompt` is text (HTTP) or None (token ids only)."""

    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None
    group: int = 0                      # shared-prefix: which prefix; random: 0
    messages: list[dict] | None = None  # chat requests (agentic replay)
    num_prompt_tokens: int | None = None  # when prompt_token_ids are not materialised

    @property
    def prompt_len(self) -> int:
        if self.num_prompt_tokens is not None:
            return self.num_prompt_tokens
        return len(self.prompt_token_ids)


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float
                   ) -> np.ndarray:
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(np.floor(length * (1.0 - range_ratio))))
    hi = max(lo, int(np.ceil(length * (1.0 + range_ratio))))
    return rng.integers(lo, hi + 1, size=n)


class WordVocab:
    """Token ids that are standalone words (see the module docstring), for exact-length text."""

    def __init__(self, tokenizer: Tokenizer, min_words: int = 64) -> None:
        ids, texts = [], []
        special = set(tokenizer.all_special_ids)
        for i in range(tokenizer.vocab_size):
            if i in special:
                continue
            s = tokenizer.decode([i], skip_special_tokens=False)
            if _WORD.fullmatch(s) and tokenizer.encode(s, add_special_tokens=False) == [i]:
                ids.append(i)
                texts.append(s)
        if len(ids) < min_words:
            raise ValueError(f"tokenizer {tokenizer.name!r} has only {len(ids)} standalone "
                             f"word tokens (need {min_words}) for exact-length text prompts")
        self.tokenizer = tokenizer
        self.ids = np.asarray(ids, dtype=np.int64)
        self.texts = texts

    def sample(self, rng: np.random.Generator, n: int) -> tuple[list[int], str]:
        """n random words -> (their ids, their text); encode(text) == ids."""
        picks = rng.integers(0, len(self.ids), size=n)
        return self.ids[picks].tolist(), self.join(picks)

    def join(self, picks: np.ndarray) -> str:
        """Text of the words at these indices of the list."""
        return "".join(self.texts[k] for k in picks.tolist())


def token_pool(vocab_size: int, special_ids: Sequence[int] = ()) -> np.ndarray:
    """Ids random token prompts draw from: the vocabulary minus special tokens."""
    mask = np.ones(vocab_size, dtype=bool)
    mask[[i for i in special_ids if 0 <= i < vocab_size]] = False
    pool = np.flatnonzero(mask)
    if pool.size == 0:
        raise ValueError("no non-special token ids to draw prompts from")
    return pool


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    pool: np.ndarray | None = None, words: WordVocab | None = None
                    ) -> list[BenchRequest]:
    """Independent random prompts. Give `pool` for token-id prompts or `words` for text."""
    if (pool is None) == (words is None):
        raise ValueError("give exactly one of pool (token ids) or words (text)")
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num, input_len, range_ratio)
    out_lens = sample_lengths(rng, num, output_len, range_ratio)
    out = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        if words is not None:
            ids, text = words.sample(rng, n_in)
            out.append(BenchRequest(ids, n_out, prompt=text))
        else:
            assert pool is not None
            out.append(BenchRequest(rng.choice(pool, size=n_in).tolist(), n_out))
    return out


def shared_prefix_requests(num: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                           output_len: int, seed: int, pool: np.ndarray | None = None,
                           words: WordVocab | None = None) -> list[BenchRequest]:
    """`num` requests, request i using prefix i % num_prefixes followed by a distinct suffix.

    Requests are ordered round-robin over prefixes (as they would arrive from independent
    users), so the first `num_prefixes` requests are the misses."""
    if (pool is None) == (words is None):
        raise ValueError("give exactly one of pool (token ids) or words (text)")
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 1 or output_len < 1:
        raise ValueError("need num_prefixes >= 1, prefix_len >= 0, suffix_len >= 1, "
                         "output_len >= 1")
    rng = np.random.default_rng(seed)

    def draw(n: int) -> tuple[list[int], str | None]:
        if words is not None:
            return words.sample(rng, n)
        assert pool is not None
        return rng.choice(pool, size=n).tolist(), None

    prefixes = [draw(prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(num):
        (p_ids, p_text), (s_ids, s_text) = prefixes[i % num_prefixes], draw(suffix_len)
        text = None if words is None else (p_text or "") + (s_text or "")
        out.append(BenchRequest(p_ids + s_ids, output_len, prompt=text, group=i % num_prefixes))
    return out
