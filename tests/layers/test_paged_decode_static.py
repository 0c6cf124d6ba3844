"""The static-shape decode attention (layers/attention/paged_decode_static.py) against the
per-request reference on random ragged decode batches: GQA group sizes, sliding windows,
chunked key walks, request rows out of order, and every entry it must not read poisoned
with NaN (past a request's context, outside its window, the null block)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from wideserve.types.forward_batch import ForwardBatch, KVGroupView
from wideserve.layers.attention.paged_attention import paged_attention
from wideserve.layers.attention.paged_decode_static import (chunk_blocks, decode_attention,
                                                            is_decode_batch, paged_decode_static)
from wideserve.layers.attention.registry import get_paged_attention_backend, static_decode

NAME = "layer.kv"


def _decode_batch(seed: int, reqs: int, kv_heads: int, groups: int, head_dim: int,
                  block_size: int, width: int, window: int | None, dtype: torch.dtype):
    """A decode batch over a poisoned cache; returns (q, k, v, batch)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    entry = 2 * kv_heads * head_dim
    num_blocks = 1 + reqs * width
    cache = torch.full((num_blocks, block_size, entry), float("nan"), dtype=dtype)
    # Ragged contexts: a lone first token, a full row, and random ones between.
    seq_lens = rng.integers(1, width * block_size + 1, reqs)
    seq_lens[0], seq_lens[-1] = 1, width * block_size
    table_rows = reqs + 3                                   # the persistent table has spares
    table = np.zeros((table_rows, width), dtype=np.int64)
    rows = rng.permutation(table_rows)[:reqs]              # request r -> table row rows[r]
    free = rng.permutation(np.arange(1, num_blocks))
    for r in range(reqs):
        n = -(-int(seq_lens[r]) // block_size)
        table[rows[r], :n] = free[:n]
        free = free[n:]
        lo = 0 if window is None else max(0, int(seq_lens[r]) - window)
        for p in range(lo, int(seq_lens[r]) - 1):           # the visible old entries
            cache[table[rows[r], p // block_size], p % block_size] = torch.randn(
                entry, generator=g).to(dtype)
    pos = seq_lens - 1
    slots = table[rows, pos // block_size] * block_size + pos % block_size
    view = KVGroupView(block_size, 1, torch.from_numpy(table),
                       slot_mapping=torch.from_numpy(slots), req_rows=torch.from_numpy(rows),
                       req_rows_cpu=rows)
    qsl = np.arange(reqs + 1)
    batch = ForwardBatch(
        input_ids=torch.zeros(reqs, dtype=torch.int64), positions=torch.from_numpy(pos),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, kv_caches={NAME: cache},
        kv_groups=[view], cache_group={NAME: 0})
    q = torch.randn(reqs, kv_heads * groups, head_dim, generator=g).to(dtype)
    k = torch.randn(reqs, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(reqs, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v, batch


def _with_cache(batch: ForwardBatch, cache: torch.Tensor) -> ForwardBatch:
    return dataclasses.replace(batch, kv_caches={NAME: cache})


CASES = [  # (reqs, kv heads, query heads per kv head, head dim, block size, width, window)
    (7, 2, 3, 16, 4, 6, None),
    (5, 1, 8, 8, 8, 4, None),       # one KV head (MQA-like)
    (6, 4, 1, 8, 4, 5, 7),          # MHA through a sliding window
    (1, 2, 2, 16, 16, 3, None),     # a single request
    (9, 2, 4, 8, 2, 9, 3),          # short window, tiny blocks
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("budget", [None, 1, 3])
def test_matches_the_reference_fp32(case, budget) -> None:
    """budget: blocks per chunk (None: the default, one chunk here)."""
    reqs, hkv, g, d, bs, width, window = case
    q, k, v, batch = _decode_batch(sum(c or 0 for c in case) + (budget or 0), reqs, hkv, g, d, bs, width,
                                   window, torch.float32)
    assert is_decode_batch(batch)
    cache = batch.kv_caches[NAME]
    ref_cache, got_cache = cache.clone(), cache.clone()
    want = paged_attention(q, k, v, _with_cache(batch, ref_cache), NAME, d ** -0.5, window)
    got_batch = _with_cache(batch, got_cache)
    if budget is None:
        got = paged_decode_static(q, k, v, got_batch, NAME, d ** -0.5, window)
    else:
        got_cache.view(-1, cache.shape[-1])[batch.kv_groups[0].slot_mapping] = \
            torch.cat((k.reshape(reqs, -1), v.reshape(reqs, -1)), -1)
        chunk = budget * reqs * bs * cache.shape[-1]
        assert chunk_blocks(reqs, width, bs, cache.shape[-1], chunk) == min(budget, width)
        got = decode_attention(q, got_cache, batch.kv_groups[0], batch.seq_lens, d ** -0.5,
                               window, budget=chunk)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(got_cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))   # same writes


def test_bf16_error_is_the_references() -> None:
    """In bf16 the op's error against an fp32 oracle (the same inputs, upcast) is the bf16
    reference's own (the output's last rounding): the maths runs in fp32."""
    q, k, v, batch = _decode_batch(11, 8, 2, 4, 32, 8, 8, None, torch.bfloat16)
    cache = batch.kv_caches[NAME]
    scale = 32 ** -0.5
    oracle = paged_attention(q.float(), k.float(), v.float(),
                             _with_cache(batch, cache.float()), NAME, scale)
    ref = paged_attention(q, k, v, _with_cache(batch, cache.clone()), NAME, scale)
    got = paged_decode_static(q, k, v, _with_cache(batch, cache.clone()), NAME, scale)
    err, ref_err = ((x.float() - oracle).abs().max().item() for x in (got, ref))
    assert err <= 1.5 * ref_err, (err, ref_err)


def test_backend_dispatch() -> None:
    """'static' takes decode batches on every device, 'batched' only off the CPU; other
    batches (here a prefill) go to the batched op under both names."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert static_decode("static", cpu) and static_decode("batched", cuda)
    assert not static_decode("batched", cpu) and not static_decode("reference", cuda)
    q, k, v, batch = _decode_batch(3, 4, 2, 2, 8, 4, 3, None, torch.float32)
    want = paged_attention(q, k, v, _with_cache(batch, batch.kv_caches[NAME].clone()), NAME, 0.3)
    for name in ("static", "batched"):
        got = get_paged_attention_backend(name)(
            q, k, v, _with_cache(batch, batch.kv_caches[NAME].clone()), NAME, 0.3, None, None)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # A prefill of 3 tokens for one request is not a decode batch.
    qsl = np.array([0, 3])
    prefill = ForwardBatch(
        input_ids=torch.zeros(3, dtype=torch.int64), positions=torch.arange(3),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.tensor([3]),
        query_start_loc_cpu=qsl, seq_lens_cpu=np.array([3]), kv_caches={}, kv_groups=[],
        cache_group={})
    assert not is_decode_batch(prefill)
