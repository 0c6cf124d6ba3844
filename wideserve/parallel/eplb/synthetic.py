"""Skewed synthetic expert loads, for policy tests and benchmarks (deterministic by seed).

Each layer ranks its experts by popularity in a random order and gives rank i a share
proportional to (i + 1) ** -skew (Zipf); the window's load is a multinomial draw of
tokens * top_k routings from those shares. `held_out` draws a later window whose shares
drifted (log-normal noise of scale `drift`), to measure how a plan ages.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SkewedLoad:
    layers: int = 8
    experts: int = 64
    tokens: int = 16384
    top_k: int = 8
    skew: float = 0.8
    drift: float = 0.1
    seed: int = 0

    def shares(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        base = (np.arange(self.experts) + 1.0) ** -self.skew
        out = np.stack([base[rng.permutation(self.experts)] for _ in range(self.layers)])
        return out / out.sum(axis=1, keepdims=True)

    def window(self, shares: np.ndarray | None = None, stream: int = 1) -> np.ndarray:
        """[L, E] int64 token counts of one window."""
        p = self.shares() if shares is None else shares
        rng = np.random.default_rng([self.seed, stream])
        return np.stack([rng.multinomial(self.tokens * self.top_k, row) for row in p])

    def held_out(self) -> np.ndarray:
        """A later window whose shares drifted from `shares()`."""
        rng = np.random.default_rng([self.seed, 2])
        p = self.shares() * np.exp(self.drift * rng.standard_normal((self.layers, self.experts)))
        return self.window(p / p.sum(axis=1, keepdims=True), stream=3)


def load_checksum(load: np.ndarray) -> str:
    """A short digest of an integer load matrix (tests check the generator did not change)."""
    return hashlib.sha256(np.ascontiguousarray(load, dtype=np.int64).tobytes()).hexdigest()[:16]
