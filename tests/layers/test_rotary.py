"""RotaryEmbedding.cos_sin: rows gathered from the cached per-position tables are the rows
it computes, at any positions and after the tables grew."""
from __future__ import annotations

import torch

from wideserve.layers.rope_rotate_half import ROPE_TABLE_MIN, RopeScaling, RotaryEmbedding


def test_table_rows_equal_computed_rows():
    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(64, 1e6, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    for bound in (1, 5, ROPE_TABLE_MIN, ROPE_TABLE_MIN + 1, 5000):   # grows twice
        for t in (1, 3, 64, 700):
            pos = torch.randint(0, bound, (t,), generator=g)
            want = rope.cos_sin(pos)                     # no bound: computed
            got = rope.cos_sin(pos, bound)
            assert all(torch.equal(a, b) for a, b in zip(want, got))
            assert got[0].dtype == torch.float32 and got[0].shape == (t, 64)
        assert rope._table[0].shape[0] >= bound
    assert rope._table[0].shape[0] == 8192
    empty = rope.cos_sin(torch.zeros(0, dtype=torch.int64), 0)
    assert empty[0].shape == (0, 64)
